"""Elastic capacity between rollout and training (QwenGyre, arXiv 2609.33848).

Capacity units (engine replicas on a cluster, worker processes here) each serve rollout
or training. When the trainer falls behind (many unconsumed shards) while the engines have
slack, the controller drains one rollout replica: it stops taking new sessions, its live
sessions run to their end, and only then is the unit handed to the trainer. When the
trainer's queue runs dry it hands a unit back. A live rollout is never interrupted.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

Role = Literal["rollout", "draining", "train"]


class ElasticConfig(BaseModel):
    """Thresholds of the rollout/training capacity policy."""

    high_backlog: int = Field(
        8,
        ge=1,
        description="Unconsumed shards at or above which the trainer is behind and may borrow a rollout unit.",
    )
    low_backlog: int = Field(
        1,
        ge=0,
        description="Unconsumed shards at or below which the trainer runs dry and returns a borrowed unit.",
    )
    max_queue_per_replica: float = Field(
        1.0, ge=0, description="Engine queue depth per rollout replica above which rollout needs more units."
    )
    max_moves_per_step: int = Field(
        2, ge=1, description="Most units moved (or set draining) by one decision."
    )
    cooldown_s: float = Field(
        120.0, ge=0, description="Seconds after a move before the next one (damps thrashing)."
    )
    min_rollout: int = Field(1, ge=1, description="Rollout units never lent to training.")
    min_train: int = Field(1, ge=1, description="Training units never handed to rollout.")


@dataclass(frozen=True)
class PolicyInputs:
    """What the controller decides on.

    ``unconsumed_shards``: committed shards the trainer has not consumed yet;
    ``engine_queue_depth``: sessions waiting for a rollout replica;
    ``trainer_idle``: fraction of the last interval the training units sat idle (0..1).
    """

    unconsumed_shards: int
    engine_queue_depth: int
    trainer_idle: float


@dataclass(frozen=True)
class Move:
    """One decision: ``unit`` goes from ``source`` to ``target`` (``draining`` ends at ``train``)."""

    time: float
    unit: str
    source: Role
    target: Role
    reason: str


@dataclass
class Unit:
    """A capacity unit and the rollout sessions live on it."""

    name: str
    role: Role
    live_sessions: int = 0


@dataclass
class ElasticController:
    """Moves units between rollout and training as their queues change.

    The router asks ``routable()`` for replicas that take new sessions and reports
    ``begin_session`` / ``end_session``; the trainer uses ``units_in("train")``; a driver calls
    ``step(inputs, now)`` periodically. ``log_record()`` is the policy's last inputs, roles
    and moves, for the ``extra`` column of ``train_steps``.
    """

    config: ElasticConfig
    units: dict[str, Unit]
    moves: list[Move] = field(default_factory=list)
    last_inputs: PolicyInputs | None = None

    @classmethod
    def create(
        cls, rollout: list[str], train: list[str], config: ElasticConfig | None = None
    ) -> ElasticController:
        """A controller with the given rollout and training units."""
        config = config or ElasticConfig()
        if set(rollout) & set(train):
            raise ValueError(f"units {sorted(set(rollout) & set(train))} are in both rollout and train")
        if len(rollout) < config.min_rollout or len(train) < config.min_train:
            raise ValueError(
                f"need at least min_rollout={config.min_rollout} rollout and min_train={config.min_train} train units"
            )
        units = {n: Unit(n, "rollout") for n in rollout} | {n: Unit(n, "train") for n in train}
        return cls(config, units)

    def units_in(self, role: Role) -> list[str]:
        """Names of the units in ``role``."""
        return [u.name for u in self.units.values() if u.role == role]

    def routable(self) -> list[str]:
        """Rollout replicas that accept new sessions."""
        return self.units_in("rollout")

    def _unit(self, name: str) -> Unit:
        if name not in self.units:
            raise KeyError(f"unknown unit {name!r}; known: {sorted(self.units)}")
        return self.units[name]

    def begin_session(self, name: str) -> None:
        """A rollout session starts on replica ``name`` (refused unless it is accepting)."""
        unit = self._unit(name)
        if unit.role != "rollout":
            raise ValueError(f"unit {name!r} is {unit.role}, it takes no new sessions")
        unit.live_sessions += 1

    def end_session(self, name: str, now: float) -> Move | None:
        """A session on ``name`` ended; a drained replica goes to training here (its session boundary)."""
        unit = self._unit(name)
        if unit.live_sessions < 1:
            raise ValueError(f"unit {name!r} has no live session to end")
        unit.live_sessions -= 1
        if unit.role == "draining" and unit.live_sessions == 0:
            return self._move(unit, "train", now, "drained at session boundary")
        return None

    def _move(self, unit: Unit, target: Role, now: float, reason: str) -> Move:
        move = Move(now, unit.name, unit.role, target, reason)
        unit.role = target
        self.moves.append(move)
        return move

    def step(self, inputs: PolicyInputs, now: float) -> list[Move]:
        """Decide on the current queues; returns the moves made now (a drain completes later)."""
        self.last_inputs = inputs
        cfg = self.config
        if self.moves and now - self.moves[-1].time < cfg.cooldown_s:
            return []
        rollout = [self.units[n] for n in self.units_in("rollout")]
        draining = [self.units[n] for n in self.units_in("draining")]
        train = self.units_in("train")
        rollout_needs = inputs.engine_queue_depth > cfg.max_queue_per_replica * max(len(rollout), 1)
        trainer_behind = inputs.unconsumed_shards >= cfg.high_backlog
        trainer_dry = inputs.unconsumed_shards <= cfg.low_backlog and inputs.trainer_idle > 0
        moves: list[Move] = []
        if rollout_needs and (trainer_dry or not trainer_behind):
            for unit in draining[: cfg.max_moves_per_step]:
                moves.append(
                    self._move(unit, "rollout", now, "drain cancelled: engines have queued sessions")
                )
            while len(moves) < cfg.max_moves_per_step and len(train) > cfg.min_train:
                unit = self._last_borrowed(train)
                train.remove(unit.name)
                moves.append(
                    self._move(unit, "rollout", now, "trainer queue ran dry, engines have queued sessions")
                )
        elif trainer_behind and not rollout_needs:
            candidates = sorted(rollout, key=lambda u: u.live_sessions)
            spare = len(rollout) - cfg.min_rollout
            for unit in candidates[: min(cfg.max_moves_per_step, spare)]:
                if unit.live_sessions == 0:
                    moves.append(self._move(unit, "train", now, "trainer behind, idle replica"))
                else:
                    moves.append(self._move(unit, "draining", now, "trainer behind, draining replica"))
        return moves

    def _last_borrowed(self, train: list[str]) -> Unit:
        """The training unit that most recently came from rollout (else the last one)."""
        for move in reversed(self.moves):
            if move.target == "train" and move.unit in train:
                return self.units[move.unit]
        return self.units[train[-1]]

    def log_record(self) -> dict:
        """Policy inputs, unit roles and the last moves, JSON-ready."""
        return {
            "elastic": {
                "inputs": asdict(self.last_inputs) if self.last_inputs else None,
                "roles": {n: u.role for n, u in self.units.items()},
                "live_sessions": {n: u.live_sessions for n, u in self.units.items()},
                "moves": [asdict(m) for m in self.moves[-8:]],
            }
        }


@dataclass
class ElasticLog:
    """Feeds a controller from the pipeline and returns its record for ``train_steps.extra``.

    With ``apply_moves`` False (the default: one machine, nothing to move) the controller
    only advises: it decides on a copy, the record says what it would have moved, and the
    roles it logs are the real ones, unchanged.
    """

    controller: ElasticController
    apply_moves: bool = False

    def record(self, inputs: PolicyInputs, now: float) -> dict:
        """Decide on ``inputs`` and return ``{"elastic": {...}}`` with the inputs, roles and decision."""
        if self.apply_moves:
            decided = self.controller.step(inputs, now)
        else:
            decided = copy.deepcopy(self.controller).step(inputs, now)
            self.controller.last_inputs = inputs
        record = self.controller.log_record()
        record["elastic"]["applied"] = self.apply_moves
        record["elastic"]["decided"] = [asdict(m) for m in decided]
        return record
