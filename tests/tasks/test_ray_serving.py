"""The rollout task serving the gateway's HTTP API on Ray: a local Ray the run starts, in a
file of its own so that ``make test`` runs it with the other tests that start Ray (see
``tests/conftest.py``)."""

from __future__ import annotations

import httpx
import ray
from ray._private import state

from rollout.ray_engine import engine_actor_resources
from tasks.rollout import connect_run_ray, rollout_actor_resources
from tests.conftest import free_port, one_ray_at_a_time
from tests.tasks.test_rollout_http import TOKEN, WAIT_S, serving_run, serving_worker, until_serving


def test_a_serve_only_worker_on_ray_starts_its_engines_and_no_env_workers(tmp_path, monkeypatch):
    """Serving only, the worker runs no env: on Ray it still started an env worker per engine
    replica, each holding a CPU of the run's placement group for nothing."""
    monkeypatch.setenv("TREADLE_GATEWAY_TOKEN", TOKEN)
    port = free_port()
    run, _ = serving_run(tmp_path, port, serve_only=True)
    run = run.model_copy(update={"cluster": "ray"})
    assert rollout_actor_resources(run) == [engine_actor_resources(run.engine.torch)]  # one replica
    with one_ray_at_a_time():
        # as the worker would connect (it then finds Ray connected), but on the main thread: the
        # shutdown of a driver connected from a thread since ended waited out 15 s of Ray's own
        # time-outs flushing its task events and metrics
        connect_run_ray(run)
        try:
            with (
                serving_worker(run) as (worker, stop),
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client,
            ):
                until_serving(client, worker)
                started = {actor["ActorClassName"] for actor in state.actors().values()}
                stop.set()
                worker.result(WAIT_S)
        finally:
            ray.shutdown()
    assert started == {"EngineHost"}
