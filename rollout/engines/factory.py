"""The factory that builds engine replicas from an ``EngineConfig``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from rollout.config import EngineConfig
from rollout.engines.base import Engine
from rollout.engines.torch_engine import TorchEngine
from rollout.engines.vllm_engine import UNKNOWN_VERSION, VLLMEngine
from storage.config import RunStore


def build_engines(
    config: EngineConfig,
    model_dir: str,
    version: int,
    cluster: Literal["local", "ray"] = "local",
    store: RunStore | None = None,
    placements: Sequence[dict[str, Any]] | None = None,
) -> list[Engine]:
    """Engine replicas serving weight version ``version`` (local directory ``model_dir``);
    vLLM replicas, clients of servers that hold weights of their own, are at
    ``UNKNOWN_VERSION`` until the caller loads ``version`` onto them.

    With ``cluster="ray"`` each torch replica runs in a Ray actor (``rollout.ray_engine``),
    returned once every actor has started (within ``config.load_timeout_s``, else an
    ``EngineError``); ``store`` lets actors on other nodes fetch the version themselves, and
    ``placements`` (one per replica, in order) places each actor in its bundle of a placement
    group the caller holds (``rollout.ray_actors.in_bundle``); None: Ray places them freely.
    A local replica that fails to load raises its error once those built before it are stopped.
    """
    if config.kind == "vllm":
        # the servers' weights are unknown until ``version`` is loaded onto them
        return [
            VLLMEngine(server, name=f"vllm-{i}", version=UNKNOWN_VERSION)
            for i, server in enumerate(config.vllm)
        ]
    if cluster == "ray":
        from rollout.ray_engine import RayEngine, engine_actor_resources, wait_started

        if placements is not None and len(placements) != config.replicas:
            raise ValueError(
                f"placements must name one per replica ({config.replicas}), got {len(placements)}"
            )
        engines = [
            RayEngine(
                config.torch,
                model_dir,
                name=f"ray-torch-{i}",
                version=version,
                store=store,
                actor_options=None
                if placements is None
                else engine_actor_resources(config.torch) | placements[i],
            )
            for i in range(config.replicas)
        ]
        return wait_started(engines, config.load_timeout_s)
    gpus = torch.cuda.device_count()
    engines: list[TorchEngine] = []
    try:
        for i in range(config.replicas):
            device = replica_device(config.torch.device, i, gpus)
            engines.append(
                TorchEngine.from_config(
                    config.torch.model_copy(update={"device": device}),
                    model_dir,
                    name=f"torch-{i}",
                    version=version,
                )
            )
    except BaseException:
        # the caller never gets the replicas built before the one that failed (out of GPU
        # memory): stopped and let go here, else they hold their GPUs for the process's life
        for engine in engines:
            engine.close_now()
        engines.clear()
        raise
    return engines


def replica_device(device: str, index: int, gpus: int) -> str:
    """The device of local torch replica ``index``: plain ``cuda`` spreads the replicas over
    the ``gpus`` visible GPUs, one each in turn; any other device is taken as given."""
    if device != "cuda" or gpus < 2:
        return device
    return f"cuda:{index % gpus}"
