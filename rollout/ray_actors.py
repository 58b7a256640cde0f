"""Starting Ray actors: waiting until each is placed on a node and constructed, or failing
the start in one line, instead of leaving the caller with actors that never answer.

Ray never restarts an actor whose constructor raised (the user's env module importable on the
driver only, a weight directory its node does not see), whatever its ``max_restarts``: every
call on it fails for the rest of the run.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class ActorStartError(RuntimeError):
    """An actor's constructor raised, or an actor or task was not started in time."""


def wait_actors_started(
    kind: str, actors: Mapping[str, ActorHandle], options: dict[str, Any], timeout_s: float, setting: str
) -> None:
    """Return once every actor of ``actors`` (by name; each has a ``pid`` method) is placed
    on a node and constructed.

    An actor whose constructor raised stops every actor of ``actors`` and raises an
    :class:`ActorStartError` ``"{kind} actor '{name}' could not start: {error}"``. Ray keeps
    an actor whose resources (``options``, each) no node has free pending for ever (an
    autoscaler may add a node): one not started within ``timeout_s`` (the config's
    ``setting``) stops them all too, and raises one naming what it asks for and what the
    cluster has; or, for actors placed in a placement group's bundles (``options``' scheduling
    strategy), naming the group instead, a bundle of which another actor still held.
    """
    refs = {actor.pid.remote(): name for name, actor in actors.items()}
    deadline = time.monotonic() + timeout_s
    pending, failed = list(refs), []
    # answers taken as they come: a constructor that raised fails the start at once, not once
    # an actor still pending has had all of timeout_s
    while pending and not failed:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
        if not ready:
            break
        failed = _failed_starts(ready, refs)
    if not pending and not failed:
        return
    for actor in actors.values():
        ray.kill(actor)
    if failed:
        name, error = failed[0]
        raise ActorStartError(f"{kind} actor {name!r} could not start: {error}")
    asked = {key: value for key, value in options.items() if key != "scheduling_strategy"}
    strategy = options.get("scheduling_strategy")
    if isinstance(strategy, PlacementGroupSchedulingStrategy):
        where, cluster = (
            f" in its bundle of placement group {strategy.placement_group.id.hex()}: the bundle still "
            "held (an earlier actor not yet stopped)",
            "",
        )
    else:
        where, cluster = ": no node of the Ray cluster had that free", f" ({_cluster_resources()})"
    raise ActorStartError(
        f"{kind} actors {[refs[ref] for ref in pending]} did not start within {timeout_s:g} s ({setting}), "
        f"asking for {asked} each{where}, or starting them took longer{cluster}"
    )


def wait_placeable(kind: str, options: dict[str, Any], timeout_s: float, setting: str) -> None:
    """Return once a Ray task asking for ``options`` (``num_cpus``, ``num_gpus`` …) has run on
    a node of the cluster, as the ``kind`` task submitted next with them will.

    Ray keeps a task whose resources no node has pending for ever (an autoscaler may add a
    node), and whoever waits on its result waits as long: a probe not run within
    ``timeout_s`` (the config's ``setting``) is cancelled and raises an
    :class:`ActorStartError` naming what it asks for and what the cluster has.
    """
    probe = ray.remote(**options)(_placed).remote()
    ready, _ = ray.wait([probe], timeout=timeout_s)
    if ready:
        return
    ray.cancel(probe)
    raise ActorStartError(
        f"the {kind} task did not start within {timeout_s:g} s ({setting}), asking for {options}: "
        f"no node of the Ray cluster had that free ({_cluster_resources()})"
    )


def reserve_together(
    what: str, requests: list[dict[str, Any]], timeout_s: float, setting: str
) -> PlacementGroup:
    """A placement group holding a bundle for each of ``requests`` (the ``num_cpus`` and
    ``num_gpus`` of tasks and actors; each asks for one at least), in their order, once the
    cluster has room for them all at once, as ``what`` asks for them together.

    Ray places each task or actor as it comes: one that waits for a CPU another holds for the
    whole run (the trainer's, waiting for rollouts) waits until that one's deadline, and one
    placed freely may take what another needs (processing on the CPU of the one node with the
    trainer's GPU). Each runs in its bundle (:func:`in_bundle`), which nothing else takes; the
    caller removes the group (``remove_placement_group``) once they are over, which stops any
    still running. A group not placed within ``timeout_s`` (the config's ``setting``) is
    removed and raises an :class:`ActorStartError` naming what they ask for and what the
    cluster has.
    """
    group = placement_group(
        [{name: request[key] for key, name in _RESOURCES.items() if request.get(key)} for request in requests]
    )
    try:
        if not group.wait(timeout_seconds=timeout_s):
            raise ActorStartError(
                f"{what} did not fit on the Ray cluster at once within {timeout_s:g} s ({setting}), asking "
                f"for {requests}: no set of its nodes had that free ({_cluster_resources()})"
            )
    except BaseException:  # a group left pending would take the room as soon as it freed
        remove_placement_group(group)
        raise
    return group


def in_bundle(group: PlacementGroup, index: int) -> dict[str, Any]:
    """The Ray option that runs a task or actor in bundle ``index`` of ``group``; what it
    starts runs outside the group (not captured), or in a bundle of its own too."""
    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=index, placement_group_capture_child_tasks=False
        )
    }


_RESOURCES = {"num_cpus": "CPU", "num_gpus": "GPU"}
"""The Ray resource of each option a task or actor asks for."""


def _placed() -> None:
    """The probe of :func:`wait_placeable`: that it ran is the answer."""


def _cluster_resources() -> str:
    return f"cluster total {ray.cluster_resources()}, free {ray.available_resources()}"


def _failed_starts(ready: list, refs: dict) -> list[tuple[str, str]]:
    """The name and error of each actor whose answered ``ready`` probe says it will never
    start: its constructor raised (:func:`_raised`), or Ray cannot place or prepare it
    (``ActorUnschedulableError``: the node it is held to is gone; ``RuntimeEnvSetupError``).
    One that died after it started is restarted."""
    failed = []
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError as exc:
            if exc.actor_init_failed:
                failed.append((refs[ref], _raised(str(exc))))
        except RayError as exc:
            failed.append((refs[ref], f"{type(exc).__name__}: {' '.join(str(exc).split())}"))
    return failed


def _raised(quoted: str) -> str:
    """The error a constructor raised, in one line, from the traceback Ray ``quoted`` for it:
    what follows its last frame, the error's type and message, whose lines may be several (a
    CUDA error's first says what failed, its last how to debug it)."""
    lines = quoted.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    after = lines[frames[-1] + 1 :] if frames else lines[-1:]
    # the last frame's code and its carets, indented, come before the error
    error = list(itertools.dropwhile(lambda line: line[:1].isspace(), after))
    return " ".join(" ".join(error).split()) or lines[-1]
