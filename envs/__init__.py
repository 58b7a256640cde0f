"""Environments (arith, guess, pytool, code, shell, dataset, agent) and their sandboxes."""

from envs.base import Env, EnvConfig, StepResult, Task
from envs.registry import REGISTRY, demonstrate, env_class, make, register, task_set
from envs.sandbox import Sandbox, SandboxConfig, SandboxError

__all__ = [
    "REGISTRY",
    "Env",
    "EnvConfig",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "StepResult",
    "Task",
    "demonstrate",
    "env_class",
    "make",
    "register",
    "task_set",
]
