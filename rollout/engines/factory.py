"""``EngineConfig`` and the factory that builds engine replicas from it."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout.engines.base import Engine
from rollout.engines.torch_engine import TorchEngine, TorchEngineConfig
from rollout.engines.vllm_engine import UNKNOWN_VERSION, VLLMEngine, VLLMEngineConfig
from storage.config import RunStore


class EngineConfig(BaseModel):
    """Which inference engines serve the rollouts."""

    # its inputs may hold credentials: errors name the field, never the value
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", hide_input_in_errors=True)

    kind: Literal["torch", "vllm"] = Field(
        "torch", description="'torch': in-process TorchEngine; 'vllm': vLLM servers."
    )
    replicas: int = Field(1, ge=1, description="TorchEngine replicas in this process (torch kind).")
    torch: TorchEngineConfig = Field(default_factory=TorchEngineConfig, description="TorchEngine settings.")
    vllm: list[VLLMEngineConfig] = Field(
        default_factory=list, description="One entry per vLLM server replica (vllm kind)."
    )
    load_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Seconds a replica may take to load a weight version, waiting for its requests in "
        "flight included; one that takes longer has failed to load it (its worker's health check retries).",
    )

    @model_validator(mode="after")
    def _servers_for_vllm(self) -> EngineConfig:
        if self.kind == "vllm" and not self.vllm:
            raise ValueError("engine.kind is 'vllm' but engine.vllm lists no server")
        return self

    @property
    def replica_count(self) -> int:
        """Engine replicas a rollout worker runs: its vLLM servers, or its TorchEngine replicas."""
        return len(self.vllm) if self.kind == "vllm" else self.replicas


def build_engines(
    config: EngineConfig,
    model_dir: str,
    version: int,
    cluster: Literal["local", "ray"] = "local",
    store: RunStore | None = None,
) -> list[Engine]:
    """Engine replicas serving weight version ``version`` (local directory ``model_dir``);
    vLLM replicas, clients of servers that hold weights of their own, are at
    ``UNKNOWN_VERSION`` until the caller loads ``version`` onto them.

    With ``cluster="ray"`` each torch replica runs in a Ray actor (``rollout.ray_engine``);
    ``store`` lets actors on other nodes fetch the version themselves.
    """
    if config.kind == "vllm":
        # the servers' weights are unknown until ``version`` is loaded onto them
        return [
            VLLMEngine(server, name=f"vllm-{i}", version=UNKNOWN_VERSION)
            for i, server in enumerate(config.vllm)
        ]
    if cluster == "ray":
        from rollout.ray_engine import RayEngine

        return [
            RayEngine(config.torch, model_dir, name=f"ray-torch-{i}", version=version, store=store)
            for i in range(config.replicas)
        ]
    gpus = torch.cuda.device_count()
    return [
        TorchEngine.from_config(
            config.torch.model_copy(update={"device": replica_device(config.torch.device, i, gpus)}),
            model_dir,
            name=f"torch-{i}",
            version=version,
        )
        for i in range(config.replicas)
    ]


def replica_device(device: str, index: int, gpus: int) -> str:
    """The device of local torch replica ``index``: plain ``cuda`` spreads the replicas over
    the ``gpus`` visible GPUs, one each in turn; any other device is taken as given."""
    if device != "cuda" or gpus < 2:
        return device
    return f"cuda:{index % gpus}"
