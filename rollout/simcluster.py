"""A discrete-event simulated cluster that drives the real scheduler and elastic controller.

``simulate_actions`` replays an agent-action workload (bursts of trajectories that think,
then call tools, run tests, and finally call a reward model) through a ``Policy`` from
``rollout.scheduler`` on a virtual clock. Nothing here reimplements a decision: the
policies are the same objects the asyncio services use. The elastic rollout/training
simulation lives in ``rollout.elastic_sim``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, Field, model_validator

from rollout.scheduler import ActionPolicy, Grant, Policy, ResourceRequest, StaticPolicy, amdahl_efficiency


class ActionWorkload(BaseModel):
    """A bursty agentic-RL action workload (each RL step launches a burst of trajectories)."""

    bursts: int = Field(4, ge=1, description="RL steps, each launching one burst of trajectories.")
    trajectories_per_burst: int = Field(
        128, ge=1, description="Trajectories launched at the start of each step."
    )
    burst_interval_s: float = Field(900.0, gt=0, description="Seconds between bursts.")
    turns_min: int = Field(4, ge=1, description="Fewest tool-using turns per trajectory.")
    turns_max: int = Field(24, ge=1, description="Most tool-using turns per trajectory.")
    think_median_s: float = Field(
        8.0, gt=0, description="Median LLM generation time before each action (lognormal)."
    )
    think_sigma: float = Field(0.6, ge=0, description="Log-space spread of the generation time.")
    p_test: float = Field(
        0.3,
        ge=0,
        le=1,
        description="Probability an action is a test run (elastic CPU), else a shell/tool call.",
    )
    tool_median_s: float = Field(1.0, gt=0, description="Median single-core duration of a shell/tool call.")
    tool_sigma: float = Field(0.8, ge=0, description="Log-space spread of tool-call durations.")
    test_median_s: float = Field(40.0, gt=0, description="Median single-core duration T_1 of a test run.")
    test_sigma: float = Field(0.8, ge=0, description="Log-space spread of test-run T_1.")
    serial_min: float = Field(0.05, ge=0, lt=1, description="Smallest Amdahl serial fraction of a test run.")
    serial_max: float = Field(0.3, ge=0, lt=1, description="Largest Amdahl serial fraction of a test run.")
    test_max_units: int = Field(16, ge=1, description="Most cores a test run can use.")
    estimate_sigma: float = Field(
        0.3, ge=0, description="Log-space error of the duration estimate the scheduler is given."
    )
    reward_median_s: float = Field(3.0, gt=0, description="Median reward-model call time on a loaded GPU.")
    services: int = Field(10, ge=1, description="Distinct reward-model services.")
    service_zipf: float = Field(1.0, ge=0, description="Zipf exponent of service popularity (0: uniform).")
    load_s: float = Field(
        4.0, ge=0, description="Seconds to load a parked service onto a GPU (evict-on-execution)."
    )
    services_per_gpu: int = Field(2, ge=1, description="Services a GPU keeps resident (LRU) when pooled.")
    seed: int = Field(0, description="Random seed of the replayed workload.")

    @model_validator(mode="after")
    def _ranges_in_order(self) -> ActionWorkload:
        for low, high in (("turns_min", "turns_max"), ("serial_min", "serial_max")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"{low} ({getattr(self, low)}) must not exceed {high} ({getattr(self, high)})"
                )
        return self


@dataclass
class _Action:
    think_s: float
    request: ResourceRequest
    true_t1: float
    service: int = -1


@dataclass
class _Trajectory:
    tid: str
    start: float
    actions: list[_Action]
    next: int = 0


def action_trajectories(w: ActionWorkload) -> list[_Trajectory]:
    """The replayed trajectories of workload ``w`` (deterministic in ``w.seed``)."""
    rng = random.Random(w.seed)
    weights = [1.0 / (s + 1) ** w.service_zipf for s in range(w.services)]
    trajs = []
    for b in range(w.bursts):
        for j in range(w.trajectories_per_burst):
            tid = f"b{b}t{j}"
            actions = []
            for _ in range(rng.randint(w.turns_min, w.turns_max)):
                think = rng.lognormvariate(math.log(w.think_median_s), w.think_sigma)
                noise = rng.lognormvariate(0.0, w.estimate_sigma)
                if rng.random() < w.p_test:
                    t1 = rng.lognormvariate(math.log(w.test_median_s), w.test_sigma)
                    eff = amdahl_efficiency(rng.uniform(w.serial_min, w.serial_max), w.test_max_units)
                    req = ResourceRequest(
                        elastic="cpu",
                        max_units=w.test_max_units,
                        duration=t1 * noise,
                        efficiency=eff,
                        kind="test",
                        trajectory_id=tid,
                    )
                else:
                    t1 = rng.lognormvariate(math.log(w.tool_median_s), w.tool_sigma)
                    req = ResourceRequest(
                        demand={"cpu": 1}, duration=t1 * noise, kind="tool", trajectory_id=tid
                    )
                actions.append(_Action(think, req, t1))
            service = rng.choices(range(w.services), weights)[0]
            t1 = rng.lognormvariate(math.log(w.reward_median_s), 0.3)
            think = rng.lognormvariate(math.log(w.think_median_s), w.think_sigma)
            req = ResourceRequest(
                demand={"gpu": 1},
                duration=t1 * rng.lognormvariate(0.0, w.estimate_sigma),
                kind=f"reward/{service}",
                trajectory_id=tid,
            )
            actions.append(_Action(think, req, t1, service))
            trajs.append(_Trajectory(tid, b * w.burst_interval_s, actions))
    return trajs


class _GpuPool:
    """Which pooled GPU serves a reward call, and whether the service must be loaded first.

    A call goes to a free GPU where its service is resident; otherwise the service is
    loaded (evict on execution) onto the free GPU that loses least: one with an empty slot,
    else the one whose least recently used service was used longest ago (LRU over the pool).
    A service is last used when its call ends, as ``ServiceManager`` counts it.
    """

    def __init__(self, gpus: int, per_gpu: int):
        self.busy = [False] * gpus
        self.resident: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(gpus)]
        self.per_gpu = per_gpu
        self.loads = 0
        self._calls = itertools.count()

    def _victim_last_use(self, g: int) -> int:
        res = self.resident[g]
        return -1 if len(res) < self.per_gpu else next(iter(res.values()))

    def take(self, service: int) -> tuple[int, bool]:
        free = [g for g, b in enumerate(self.busy) if not b]
        if not free:
            raise RuntimeError("policy granted a GPU while all GPUs are busy")
        hit = next((g for g in free if service in self.resident[g]), None)
        g = hit if hit is not None else min(free, key=self._victim_last_use)
        self.busy[g] = True
        res = self.resident[g]
        if hit is None:
            self.loads += 1
            if len(res) >= self.per_gpu:
                res.popitem(last=False)
        res[service] = next(self._calls)
        res.move_to_end(service)
        return g, hit is None

    def give_back(self, g: int, service: int) -> None:
        """GPU ``g``'s call to ``service`` ended: the GPU is free and the service last used now."""
        self.busy[g] = False
        self.resident[g][service] = next(self._calls)
        self.resident[g].move_to_end(service)


@dataclass
class ActionRun:
    """What a simulated action run measured."""

    completion_times: list[float]
    by_kind: dict[str, list[float]]
    makespan: float
    peak: dict[str, float]
    busy_unit_seconds: dict[str, float]
    waits_by_kind: dict[str, list[float]]
    service_loads: int = 0

    @property
    def mean_act(self) -> float:
        """Average action completion time (queueing + execution), seconds."""
        return sum(self.completion_times) / len(self.completion_times)


def simulate_actions(
    workload: ActionWorkload,
    route: Callable[[ResourceRequest], Policy],
    policies: list[Policy],
    *,
    pooled_gpus: int = 0,
) -> ActionRun:
    """Replay ``workload`` through the policies (``route`` picks one per request).

    With ``pooled_gpus`` reward calls run on any pooled GPU and pay ``load_s`` when their
    service is not resident there; otherwise services are pinned (always resident).
    """
    trajs = action_trajectories(workload)
    events: list = []
    seq = itertools.count()
    for tr in trajs:
        heapq.heappush(events, (tr.start + tr.actions[0].think_s, next(seq), "ready", tr, None))
    gpus = _GpuPool(pooled_gpus, workload.services_per_gpu) if pooled_gpus else None
    meta: dict[int, tuple[_Trajectory, _Action, int]] = {}
    inflight: dict[tuple[int, int], tuple[_Trajectory, _Action]] = {}
    completion: list[float] = []
    by_kind: dict[str, list[float]] = {}
    waits: dict[str, list[float]] = {}
    used = {name: 0.0 for p in policies for name in p.capacity}
    peak = dict(used)
    busy = dict(used)
    now = 0.0

    def dispatch(t: float) -> None:
        for p_i, policy in enumerate(policies):
            for grant in policy.dispatch(t):
                tr, action = inflight.pop((p_i, grant.ticket))
                run_s = grant.request.duration_on(grant.units, action.true_t1)
                gpu = -1
                if gpus is not None and action.service >= 0:
                    gpu, miss = gpus.take(action.service)
                    run_s += workload.load_s if miss else 0.0
                for name, a in grant.allocation.items():
                    used[name] += a
                    peak[name] = max(peak[name], used[name])
                    busy[name] += a * run_s
                meta[id(grant)] = (tr, action, gpu)
                heapq.heappush(events, (t + run_s, next(seq), "done", grant, p_i))

    while events:
        now, _, kind, obj, p_i = heapq.heappop(events)
        if kind == "ready":
            tr = obj
            action = tr.actions[tr.next]
            policy_i = policies.index(route(action.request))
            ticket = policies[policy_i].submit(action.request, now)
            inflight[(policy_i, ticket)] = (tr, action)
        else:
            grant: Grant = obj
            tr, action, gpu = meta.pop(id(grant))
            policies[p_i].release(grant, now)
            for name, a in grant.allocation.items():
                used[name] -= a
            if gpu >= 0:
                gpus.give_back(gpu, action.service)
            act = now - grant.enqueued_at
            completion.append(act)
            kind_name = grant.request.kind.split("/")[0]
            by_kind.setdefault(kind_name, []).append(act)
            waits.setdefault(kind_name, []).append(grant.started_at - grant.enqueued_at)
            tr.next += 1
            if tr.next < len(tr.actions):
                heapq.heappush(events, (now + tr.actions[tr.next].think_s, next(seq), "ready", tr, None))
            else:
                for policy in policies:
                    policy.end_trajectory(tr.tid, now)
        if not events or events[0][0] > now:
            dispatch(now)
    if inflight:
        raise RuntimeError(f"{len(inflight)} actions never got resources")
    return ActionRun(completion, by_kind, now, peak, busy, waits, gpus.loads if gpus else 0)


def run_ours(workload: ActionWorkload, cores: int, gpus: int) -> ActionRun:
    """Action-level scheduling: one pool of ``cores`` and ``gpus`` for every action."""
    policy = ActionPolicy({"cpu": cores, "gpu": gpus}, default_duration=workload.tool_median_s)
    return simulate_actions(workload, lambda r: policy, [policy], pooled_gpus=gpus)


def run_static(
    workload: ActionWorkload, cores: int, cores_per_trajectory: int, gpus_per_service: int
) -> ActionRun:
    """Static baseline: cores reserved per trajectory for its life; GPUs pinned per service."""
    cpu = StaticPolicy({"cpu": cores}, {"cpu": cores_per_trajectory})
    gpu = StaticPolicy(
        {"gpu": gpus_per_service * workload.services}, {"gpu": gpus_per_service}, key=lambda r: r.kind
    )
    return simulate_actions(workload, lambda r: gpu if "gpu" in r.demand else cpu, [cpu, gpu])
