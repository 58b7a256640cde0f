"""On Ray the pipeline's tasks and the rollout worker's actors run in the bundles of the
placement group that found room for them all at once, held until the run is over: on a
cluster of two nodes (Ray's ``cluster_utils``, on this machine), one of them with the only
GPU (a declared resource; nothing uses a device), a job that asks for that GPU between the
check and the start gets nothing, and the trainer its bundle there."""

from __future__ import annotations

import pytest
import ray
import torch
from prefect_ray.context import RemoteOptionsContext
from ray._private import state
from ray.cluster_utils import Cluster
from ray.util import placement_group_table
from ray.util.placement_group import placement_group, remove_placement_group

from flows import pipeline
from flows.config import RunConfig
from rl.models import TinyModelConfig, build_tiny_model, publish_policy
from rollout.engines.base import EngineError
from rollout.engines.factory import EngineConfig, build_engines
from rollout.ray_actors import ActorStartError, in_bundle, reserve_together
from rollout.ray_env import RayEnvPool
from storage.config import RunStore, StorageConfig
from storage.weights import WeightStore
from tasks.rollout import rollout_actor_resources, run_rollouts
from tests.conftest import one_ray_at_a_time

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def cluster():
    """A head node with 2 CPUs and a node with 2 CPUs and a GPU; the GPU node's id."""
    torch.set_num_threads(1)
    with one_ray_at_a_time():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        gpu_node = cluster.add_node(num_cpus=2, num_gpus=1)
        ray.init(address=cluster.address, log_to_driver=False, namespace="treadle-tests")
        yield gpu_node.node_id
        ray.shutdown()
        cluster.shutdown()


@ray.remote
def placed() -> tuple[str, str | None]:
    """The node a task runs on and the placement group it runs in."""
    context = ray.get_runtime_context()
    return context.get_node_id(), context.get_placement_group_id()


@ray.remote
class Job:
    """Another job's actor, asking for what the run's trainer needs."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def actor_nodes(cls: str) -> dict[str, str]:
    """The node each actor of class ``cls`` ever started ran on, by actor id (dead ones kept)."""
    return {
        actor_id: actor["Address"]["NodeID"]
        for actor_id, actor in state.actors().items()
        if actor["ActorClassName"] == cls and actor["Address"]["NodeID"]
    }


def test_the_pipelines_tasks_and_actors_run_in_the_bundles_held_for_the_run(cluster, tmp_path, monkeypatch):
    """Processing, the trainer (a GPU) and the rollout worker's env worker and engine (a CPU
    each) fill the cluster. Checked and then let go, the room was anyone's: another job asking
    for the GPU node's CPU and GPU right after the check could take them, the trainer left
    pending for ever. Held, each task runs in its bundle of the group, on that bundle's node,
    and the rollout task (which asks for nothing) starts its actors in theirs; the other job
    gets nothing until the run is over and the group removed."""
    gpu_node = cluster
    config = RunConfig(
        run_id="held",
        storage=StorageConfig(root=str(tmp_path)),
        cluster="ray",
        trainer_device="cuda",
        engine={"replicas": 1, "load_timeout_s": 120},
        orchestrator={"mix": {"arith": 1.0}, "concurrency": 2},
        service={"max_new_tokens": 4},
        stop={"max_rollouts": 2},
    )
    publish_policy(
        WeightStore(RunStore(config.storage, config.run_id)), *build_tiny_model(TINY), step=0, tag="base"
    )
    before = {cls: actor_nodes(cls) for cls in ("EnvWorkerActor", "EngineHost")}
    ran, held, during, other_job = {}, {}, {}, []

    @ray.remote
    def rollouts(placements):
        run_rollouts(config, deadline=float("inf"), placements=placements)

    class Runner:
        """Submits each task as the Ray task prefect-ray makes of it, under its remote options,
        after another job asked for the trainer's GPU."""

        def __init__(self, address=None):
            pass

        def __enter__(self):
            other_job.append(Job.options(num_cpus=1, num_gpus=1).remote())
            return self

        def __exit__(self, *exc_info):
            pass

        def submit(self, task, parameters):
            options = RemoteOptionsContext.get().current_remote_options
            if task.name == "rollouts":
                return task.name, rollouts.options(**options).remote(parameters["placements"])
            held[task.name] = options["scheduling_strategy"]
            return task.name, placed.options(**options).remote()

    def wind_down(config, signals, *runs):
        for name, ref in runs:
            ran[name] = ray.get(ref, timeout=300)
        group = held["train"].placement_group
        during.update(placement_group_table(group))
        assert state.actors(other_job[0]._actor_id.hex())["State"] != "ALIVE"
        return group

    monkeypatch.setattr("prefect_ray.task_runners.RayTaskRunner", Runner)
    monkeypatch.setattr(pipeline, "_wind_down", wind_down)

    try:
        group = pipeline._run_on_ray(config, signals="s")

        assert during["state"] == "CREATED"
        assert placement_group_table(group)["state"] == "REMOVED"
        bundle_nodes = during["bundles_to_node_id"]
        assert bundle_nodes[1] == gpu_node  # the trainer's: the only GPU
        for name, index in (("process-shards", 0), ("train", 1)):
            assert held[name].placement_group_bundle_index == index
            assert ran[name] == (bundle_nodes[index], group.id.hex())
        for cls, index in (("EnvWorkerActor", 2), ("EngineHost", 3)):
            started = {actor: node for actor, node in actor_nodes(cls).items() if actor not in before[cls]}
            assert list(started.values()) == [bundle_nodes[index]], cls
        # the run over, its room is free again
        assert ray.get(other_job[0].node.remote(), timeout=300) == gpu_node
    finally:
        for actor in other_job:
            ray.kill(actor)


@pytest.mark.parametrize("error", [RuntimeError("a task failed"), KeyboardInterrupt()])
def test_a_run_that_fails_or_is_stopped_removes_its_placement_group(cluster, monkeypatch, error):
    """A run whose task failed, or that is cancelled (interrupted), lets go of its room too."""
    groups = []

    class Runner:
        def __init__(self, address=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            pass

        def submit(self, task, parameters):
            groups.append(RemoteOptionsContext.get().current_remote_options.get("scheduling_strategy"))

    def wind_down(config, signals, *runs):
        assert placement_group_table(groups[-1].placement_group)["state"] == "CREATED"
        raise error

    monkeypatch.setattr("prefect_ray.task_runners.RayTaskRunner", Runner)
    monkeypatch.setattr(pipeline, "_wind_down", wind_down)

    with pytest.raises(type(error)):
        pipeline._run_on_ray(RunConfig(run_id="failed", cluster="ray"), signals="s")
    assert placement_group_table(groups[-1].placement_group)["state"] == "REMOVED"


def test_a_placement_group_the_cluster_cannot_hold_is_removed_with_its_error(cluster):
    """Left pending, the group of a run that gave up would take the room as soon as it freed,
    from the next run or another job."""
    before = set(placement_group_table())
    with pytest.raises(
        ActorStartError, match=r"^the run did not fit on the Ray cluster at once within 0\.5 s"
    ):
        reserve_together("the run", [{"num_cpus": 1}, {"num_cpus": 8}], 0.5, "engine.load_timeout_s")
    (given_up,) = set(placement_group_table()) - before
    assert placement_group_table()[given_up]["state"] == "REMOVED"


def test_a_workers_actors_ask_for_their_bundles_in_the_order_its_placements_are_handed_out():
    """``run_rollouts`` hands the first placements to its env workers and the rest to its
    torch engines: the GPU bundles the run holds must come last, one per engine replica."""
    engine = {"replicas": 2, "torch": {"device": "cuda"}}
    config = RunConfig(cluster="ray", engine=engine)
    cpu, gpu = {"num_cpus": 1}, {"num_cpus": 1, "num_gpus": 1}
    assert rollout_actor_resources(config) == [cpu, cpu, gpu, gpu]
    servers = [{"base_url": "http://127.0.0.1:8000"}, {"base_url": "http://127.0.0.1:8001"}]
    vllm = RunConfig(cluster="ray", engine={"kind": "vllm", "vllm": servers})
    assert rollout_actor_resources(vllm) == [cpu, cpu]  # its engines are servers, no Ray actors


def test_placements_that_do_not_name_one_per_actor_are_refused():
    with pytest.raises(ValueError, match=r"^placements must name one per worker \(2\), got 1$"):
        RayEnvPool({}, num_workers=2, placements=[{}])
    with pytest.raises(ValueError, match=r"^placements must name one per replica \(2\), got 3$"):
        build_engines(EngineConfig(replicas=2), "/unused", 0, "ray", placements=[{}] * 3)


def test_engine_and_env_actors_whose_bundles_are_held_fail_the_start_naming_their_group(cluster):
    """An actor placed in a bundle still held (an earlier attempt's actor not yet stopped)
    that does not start in time fails the start in one line that names the placement group,
    not the scheduling strategy's object nor a cluster short of room."""
    group = placement_group([{"CPU": 1}])
    ray.get(group.ready(), timeout=300)
    holder = Job.options(num_cpus=1, **in_bundle(group, 0)).remote()
    try:
        ray.get(holder.node.remote(), timeout=300)
        with pytest.raises(EngineError) as engine:
            build_engines(
                EngineConfig(replicas=1, load_timeout_s=0.5),
                "/unused",
                0,
                "ray",
                placements=[in_bundle(group, 0)],
            )
        pool = RayEnvPool({}, num_workers=1, placements=[in_bundle(group, 0)])
        with pytest.raises(ActorStartError) as env:
            pool.wait_started(0.5)
        for kind, name, error in (("engine", "ray-torch-0", engine), ("env", "env-worker-0", env)):
            assert str(error.value) == (
                f"{kind} actors [{name!r}] did not start within 0.5 s (engine.load_timeout_s), asking for "
                f"{{'max_restarts': -1, 'num_cpus': 1}} each in its bundle of placement group "
                f"{group.id.hex()}: the bundle still held (an earlier actor not yet stopped), or starting them "
                "took longer"
            )
    finally:
        ray.kill(holder)
        remove_placement_group(group)
