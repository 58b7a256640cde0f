"""``RayEngine`` against its ``EngineHost`` run in this process, through a stand-in for Ray's
actor handle (no Ray instance): what the driver makes of an actor Ray restarted."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import ray

from rl.models import TinyModelConfig, build_tiny_model, publish_policy
from rollout import ray_engine
from rollout.engines.base import SamplingParams
from rollout.engines.torch_engine import TorchEngineConfig
from rollout.ray_engine import EngineHost, RayEngine
from storage.config import RunStore, StorageConfig
from storage.weights import WeightStore

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0, seed=7)


class _Restartable:
    """An actor handle whose host runs here; :meth:`restart` builds a new one from the first
    arguments, as Ray restarts an actor."""

    def __init__(self, *args):
        self.args = args
        self.hosts = [EngineHost(*args)]

    def restart(self) -> None:
        self.hosts.append(EngineHost(*self.args))

    def __getattr__(self, method: str):
        handle = self

        class Method:
            @staticmethod
            def remote(*args):
                answer = getattr(handle.hosts[-1], method)(*args)
                if inspect.isawaitable(answer):
                    return asyncio.ensure_future(answer)
                done = asyncio.get_running_loop().create_future()
                done.set_result(answer)
                return done

        return Method


@pytest.fixture
def weights(tmp_path):
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "host")
    weights = WeightStore(store)
    model, tokenizer = build_tiny_model(TINY)
    publish_policy(weights, model, tokenizer, step=0, tag="base")
    publish_policy(weights, model, tokenizer, step=1, parent=0)
    return weights


def test_an_actor_restarted_in_a_process_of_the_same_pid_is_seen_serving_its_start_version(
    weights, monkeypatch
):
    """Ray may restart an actor on another node, in a process whose id is the one the dead
    actor had on its node (two containers of one image start their processes alike). The
    driver took the same pid for the same process: it kept claiming the version loaded onto
    the dead actor, so the worker's health check never loaded it onto the new one, which
    served its start version as if it were the worker's."""
    handles: list[_Restartable] = []

    class Actor:
        @staticmethod
        def options(**options):
            class Started:
                @staticmethod
                def remote(*args):
                    handles.append(_Restartable(*args))
                    return handles[-1]

            return Started

    monkeypatch.setattr(ray_engine, "EngineActor", Actor)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)

    async def body():
        engine = RayEngine(TorchEngineConfig(), weights.load(0), name="same-pid", version=0)
        (handle,) = handles
        try:
            await engine.load_version(1, weights.load(1))
            handle.restart()  # its process has this process's pid, as the first one had
            healthy = await engine.health()
            generation = await engine.generate("s", [5, 17, 42, 8], PARAMS)
            return healthy, engine.version, generation.versions
        finally:
            for host in handle.hosts:
                await host.close()

    healthy, version, served = asyncio.run(body())
    assert healthy
    assert served == [0] * len(served)
    assert version == 0, "the engine still claims the version loaded onto its dead actor"


@pytest.mark.parametrize("ray_address", [None, "", "local"])
def test_ray_address_local_in_the_environment_starts_the_runs_own_ray_on_loopback(monkeypatch, ray_address):
    """``RAY_ADDRESS=local`` asks Ray for a new local instance, as no address does: the run's
    was started by ``ray.init()`` alone, on the machine's address (every interface) and with
    Ray's CPU count rather than the run's, as though it named a cluster to join."""
    started = []
    monkeypatch.setattr(ray_engine.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_engine.ray, "init", lambda **kwargs: started.append(("init", kwargs)))
    monkeypatch.setattr(
        ray_engine, "_start_on_loopback", lambda num_cpus: started.append(("loopback", num_cpus))
    )
    if ray_address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", ray_address)
    ray_engine.connect_ray(None, num_cpus=5)
    assert started == [("loopback", 5)]
