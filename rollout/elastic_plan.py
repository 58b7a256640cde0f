"""The elastic controller over a run's real units, deciding from and publishing to storage.

The trainer runs an :class:`ElasticPlanner`: its units are the rollout workers' engine
replicas, named ``<worker>/<replica>`` from the status each worker publishes
(``storage.status.RolloutStatus.replica_sessions``), plus the trainer's own unit(s). Each
decision syncs the units with the fresh statuses, steps the controller, and returns the
plan (``storage.status.ElasticPlan``) the workers apply through their routers.

A replica lent to training drains first, an idle one too, and counts as handed to training
only once its worker confirms it: a status that applied a plan at least as new as the
drain, lists the replica as draining, and pins no session to it (a status seconds old that
shows it empty does not: the worker's router pins new sessions to it until it applies the
plan). A replica in training whose status shows sessions pinned, or shows it not draining
(its worker reopened it, or ignores the plan), drains again. Each worker keeps at least
one accepting replica (its orchestrator's new sessions need one): the controller never
drains a worker's last accepting replica, on top of its own ``min_rollout``.
A live rollout is never interrupted: a drained replica's sessions move at their next turn,
a generation in flight finishes where it started (``rollout.router``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rollout.elastic import ElasticConfig, ElasticController, Move, PolicyInputs, Unit
from storage.status import ElasticPlan, RolloutStatus

TRAINER_UNIT = "train0"
"""The trainer's own unit: never lent to rollout, never in a plan."""


def replica_unit(worker: str, replica: str) -> str:
    """The unit name of ``worker``'s engine replica ``replica``."""
    return f"{worker}/{replica}"


def _worker_of(unit: str) -> str | None:
    return unit.split("/", 1)[0] if "/" in unit else None


@dataclass
class ReplicaController(ElasticController):
    """An :class:`ElasticController` whose rollout units are workers' replicas: it never drains
    a worker's last accepting replica (each worker keeps its most loaded one), lends a
    replica only by draining it (its worker's confirmation hands it over, see the module
    docstring), keeps ``headroom_slots`` free on the drained replica's own worker (its
    sessions move only there), and hands back only replicas, never a trainer unit (no worker
    serves one)."""

    def _lend(self, unit: Unit, now: float, reason: str) -> Move:
        return self._move(unit, "draining", now, f"{reason} drains")

    def _drain_order(self, rollout: list[Unit], now: float) -> list[Unit]:
        kept: dict[str, Unit] = {}
        for unit in sorted(rollout, key=lambda u: -u.live_sessions):
            kept.setdefault(_worker_of(unit.name) or unit.name, unit)
        keep = {id(unit) for unit in kept.values()}
        return [unit for unit in super()._drain_order(rollout, now) if id(unit) not in keep]

    def _return_order(self, train: list[str]) -> list[str]:
        return [name for name in super()._return_order(train) if _worker_of(name) is not None]

    def _pool(self, unit: Unit) -> str | None:
        # a worker's router moves a drained replica's sessions only to that worker's replicas
        return _worker_of(unit.name)


class ElasticPlanner:
    """Decides with a :class:`ReplicaController` over the workers' replicas; see the module docstring.

    Args:
        config: the controller's thresholds (``min_train`` counts the trainer units).
        trainer_units: names of the trainer's own units (no ``/`` in them).
    """

    def __init__(self, config: ElasticConfig | None = None, trainer_units: tuple[str, ...] = (TRAINER_UNIT,)):
        config = config or ElasticConfig()
        if len(trainer_units) < config.min_train:
            raise ValueError(
                f"need at least min_train={config.min_train} trainer units, got {list(trainer_units)}"
            )
        if any("/" in name for name in trainer_units):
            raise ValueError(f"trainer unit names may not contain '/': {list(trainer_units)}")
        if len(set(trainer_units)) != len(trainer_units):
            raise ValueError(f"trainer unit names must differ: {list(trainer_units)}")
        self.trainer_units = trainer_units
        self.controller = ReplicaController(config, {name: Unit(name, "train") for name in trainer_units})
        self.last_plan: ElasticPlan | None = None
        self._finished: dict[str, tuple[int, int]] = {}
        self._ended: dict[str, int] = {}

    def observe(self, statuses: list[RolloutStatus], now: float) -> list[Move]:
        """Sync the replica units with the fresh running workers' ``statuses``.

        New replicas join as rollout units, those of workers no longer reporting leave, and
        each unit's live sessions become its pinned count, started ``age`` seconds before
        ``now`` each (the status's own delay, a few seconds at most, is not subtracted). The
        trajectories of the rollouts each worker finished (``finished_rows``: a compacted
        rollout writes one per context; one a rollout from a worker that does not count them)
        and the sessions it ended since its last status count as finished now (the
        controller's rate, in trajectories as the trainer's cost is) and train its
        session-length model (the newest lengths, each with its session's contexts: a
        compacted rollout is one session, whose rows, one per context, reach the trainer when
        its last context ends, ``rollout.router.Router``); a worker's first status, or a
        restarted worker's, only sets where its counts start. Returns the moves made here:
        draining replicas that their worker confirms empty go to training, replicas in
        training that their worker reports sessions on, or no longer drains, drain again (see
        the module docstring).
        """
        seen: dict[str, tuple[RolloutStatus, str]] = {}
        for status in statuses:
            if not status.running:
                continue
            produced = status.finished if status.finished_rows is None else status.finished_rows
            last = self._finished.get(status.worker)
            if last is not None and status.finished >= last[0] and produced >= last[1]:
                self.controller.record_finished(produced - last[1], now)
            self._finished[status.worker] = (status.finished, produced)
            last = self._ended.get(status.worker)
            if last is not None and status.sessions_ended > last:
                lengths = status.session_lengths
                contexts = status.session_contexts
                if len(contexts) != len(lengths):  # a worker that does not count them
                    contexts = [1] * len(lengths)
                new = min(status.sessions_ended - last, len(lengths))
                for length, rows in zip(
                    lengths[len(lengths) - new :], contexts[len(lengths) - new :], strict=True
                ):
                    self.controller.lengths.record(length, rows)
            self._ended[status.worker] = status.sessions_ended
            for replica in status.replica_sessions:
                seen[replica_unit(status.worker, replica)] = (status, replica)
        units = self.controller.units
        for name in [n for n in units if _worker_of(n) is not None and n not in seen]:
            del units[name]
        moves = []
        for name, (status, replica) in seen.items():
            unit = units.setdefault(name, Unit(name, "rollout"))
            if unit.role_since is not None and unit.role_since > now:
                # the wall clock stepped back: the plans made from now on, stamped before the
                # move, would not confirm it until the clock caught up with it
                unit.role_since = now
            unit.live_sessions = status.replica_sessions[replica]
            unit.session_starts = [now - age for age in status.session_ages.get(replica, [])]
            if unit.role == "draining" and unit.live_sessions == 0 and self._confirmed(status, replica, unit):
                # the controller's own handover happens on a session-end event; here the
                # worker's status says the replica is empty
                moves.append(
                    self.controller._move(unit, "train", now, "drained: its worker reports no session pinned")
                )
            elif unit.role == "train" and (unit.live_sessions > 0 or replica not in status.draining):
                # not draining: its worker reopened it (its last replica in service) or ignores
                # the plan, and pins new sessions to it
                why = "reports sessions pinned" if unit.live_sessions else "takes new sessions on it"
                moves.append(self.controller._move(unit, "draining", now, f"its worker {why}: drains again"))
        return moves

    def _confirmed(self, status: RolloutStatus, replica: str, unit: Unit) -> bool:
        """Whether the worker's ``status`` applied a plan at least as new as ``unit``'s drain."""
        return (
            unit.role_since is not None
            and status.plan_time is not None
            and status.plan_time >= unit.role_since
            and replica in status.draining
        )

    def decide(self, statuses: list[RolloutStatus], inputs: PolicyInputs, now: float) -> dict:
        """Sync with ``statuses``, step the controller on ``inputs`` and make the plan (``last_plan``).

        Returns ``{"elastic": {...}}`` for ``train_steps.extra``: the controller's inputs,
        roles and recent moves, the decision's ``time`` and ``decided``, the moves it made.
        """
        decided = self.observe(statuses, now)
        decided += self.controller.step(inputs, now)
        self.last_plan = self.plan(now)
        record = self.controller.log_record()
        record["elastic"]["time"] = now
        record["elastic"]["decided"] = [asdict(m) for m in decided]
        return record

    def plan(self, now: float) -> ElasticPlan:
        """The replicas' roles now, as a plan stamped ``now``."""
        roles: dict[str, list[str]] = {"rollout": [], "draining": [], "train": []}
        for name, unit in sorted(self.controller.units.items()):
            if _worker_of(name) is not None:
                roles[unit.role].append(name)
        return ElasticPlan(
            time=now, accepting=roles["rollout"], draining=roles["draining"], train=roles["train"]
        )

    def release(self, now: float) -> ElasticPlan:
        """The plan for a stopped trainer: every known replica accepts new sessions again."""
        replicas = sorted(n for n in self.controller.units if _worker_of(n) is not None)
        return ElasticPlan(time=now, accepting=replicas, running=False)
