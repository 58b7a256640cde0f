"""The continuous SAO / GRPO trainer.

It reads processed shards as they are committed, drops samples that are too stale,
batches the rest by a token budget and, for each policy step, runs K critic steps, computes
advantages with the updated critic (observation-skip GAE) and takes a DIS policy step
(PAPERS.md, SAO). Every ``publish_every`` steps (or only as it stops) it publishes a weight
version whose extra files hold everything a restarted trainer needs: optimizer states, the
value model, the step counter and the shards (and rows) consumed. Consumption is recorded
only in published versions, so after a crash the rows consumed since ``LATEST`` are read and
trained again, and every committed trajectory ends up in exactly one published version.

Read the loop in :meth:`Trainer.run`; one policy step in :meth:`Trainer._train_step`.
"""

from __future__ import annotations

import io
import json
import logging
import math
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import NoReturn

import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rl.advantages import adaptive_lambda, group_advantages, skip_observation_gae
from rl.batching import Batch, Sample, micro_batches, pad_batch, samples_from_table, take_batch
from rl.config import SAOConfig
from rl.logprobs import check_temperature, token_logprobs
from rl.losses import dis_policy_loss, explained_variance, value_loss
from rl.models import (
    ValueModel,
    disable_dropout,
    enable_activation_checkpointing,
    load_trained_policy,
    padding_id,
    placed,
    publish_policy,
)
from storage.config import RunStore
from storage.schema import SchemaError
from storage.shards import ShardInfo, ShardReader
from storage.status import HeldRole, InUse
from storage.tables import Tables, conform
from storage.weights import CorruptVersion, WeightStore, versions_ahead

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
POLICY_OPTIMIZER_FILE = "policy_optimizer.pt"
VALUE_MODEL_FILE = "value_model.safetensors"
VALUE_OPTIMIZER_FILE = "value_optimizer.pt"
NON_FINITE_CRITIC = "non-finite critic loss or gradient norm"
MAX_UNWRITTEN_ROWS = 1000
"""``train_steps`` rows whose append failed that the trainer keeps to append with the next
row; past it the oldest are dropped."""


def execution_mean_reward(samples: Sequence[Sample]) -> float:
    """Mean reward of the executions ``samples`` hold, each execution once (the mean of its
    samples'): a compacted rollout's contexts are samples of one execution sharing its reward,
    which a mean over samples would count once per context."""
    rewards: dict[str, list[float]] = {}
    for sample in samples:
        rewards.setdefault(sample.execution_id, []).append(sample.reward)
    return sum(sum(r) / len(r) for r in rewards.values()) / len(rewards)


def token_values(
    value_model: ValueModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The critic's value of the state in which each token was chosen.

    The value head's output at position ``t − 1`` (the prefix before token ``t``) is the
    value of token ``t``, aligned like :func:`~rl.logprobs.token_logprobs`.

    Returns:
        ``(B, T)`` float32; position 0 is 0.
    """
    out = value_model(input_ids, attention_mask.long()).float()
    return F.pad(out[:, :-1], (1, 0))


def generated_versions(table: pa.Table) -> set[int]:
    """The distinct weight versions in a processed shard's ``versions`` column (−1 marks a
    token no version generated)."""
    flat = pc.list_flatten(table.column("versions"))
    return {int(v) for v in pc.unique(pc.drop_null(flat)).to_pylist()}


def resume_optimizer(optimizer: torch.optim.Optimizer, path: Path, lr: float, weight_decay: float) -> None:
    """Load ``optimizer``'s saved moments and step counts from ``path``, keeping this run's
    settings: ``load_state_dict`` also restores the saved learning rate and weight decay,
    which would silently override a config changed for the resumed run.

    Read onto the CPU: ``load_state_dict`` moves the moments to their parameters' device but
    leaves each step count where it was read to. AdamW keeps those on the CPU; read onto a
    GPU, its every step would read each one back with ``.item()``, a sync per parameter.
    """
    optimizer.load_state_dict(
        torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
    )
    for group in optimizer.param_groups:
        group["lr"] = lr
        group["weight_decay"] = weight_decay


class NonFinitePolicy(RuntimeError):
    """The policy's parameters hold a NaN or an infinity, or (SAO) its loss or gradient norm
    does on a batch the critic has taken its steps on.

    Non-finite weights would refuse every batch after, each refusal consuming its rows, and
    the stop would publish them as rejected (with those weights); a batch cannot be refused
    once the critic moved on it. So the trainer stops: it has published nothing since its
    last version, and a restarted trainer resumes both models from that version and trains
    the rows consumed since again. The trainer that raised raises it again at its next step
    or publish (its critic may hold the batch's steps)."""


@dataclass
class StepMetrics:
    """What one policy step reports (a ``train_steps`` row, ``extra`` as a dict)."""

    row: dict
    extra: dict


@dataclass
class TrainSummary:
    """What :meth:`Trainer.run` did."""

    steps: int
    """The policy step counter at the stop: over the whole run, the steps of the versions it
    resumed from included, not those of this call alone."""
    versions: list[int]
    """The versions this call published."""
    stop_reason: str


@dataclass
class _Consumption:
    """Rows consumed (trained, dropped as stale, or rejected) per shard.

    A worker's processed shards reach the log in the order of their numbers (the worker
    numbers its raw shards upward, the process stage commits their twins in that order), so
    ``through[worker]`` says that every shard of ``worker`` numbered up to it is consumed.
    ``done`` holds the consumed shards above those marks, ``rows`` the consumed rows of
    shards in flight, ``seen`` the numbers and ids of the shards above the marks. A mark
    moves up over each run of done shards, so the state a version saves stays as small as
    what is in flight, however old the run. A second commit row of a consumed shard (two
    processors racing) is recognised by its number. ``since_publish_*`` is what the next
    published version will list.
    """

    through: dict[str, int] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    rows: dict[str, set[int]] = field(default_factory=dict)
    num_rows: dict[str, int] = field(default_factory=dict)
    seen: dict[str, dict[int, str]] = field(default_factory=dict)
    since_publish_shards: list[str] = field(default_factory=list)
    since_publish_rows: Counter = field(default_factory=Counter)

    def consumed(self, info: ShardInfo) -> bool:
        """Whether ``info`` is consumed already (below its worker's mark, or done)."""
        return info.seq <= self.through.get(info.worker, -1) or info.shard_id in self.done

    def saw(self, info: ShardInfo) -> None:
        """A consumed shard met in the log: one above its worker's mark (done before a
        restart) may let the mark pass it now."""
        if info.seq > self.through.get(info.worker, -1):
            self.seen.setdefault(info.worker, {})[info.seq] = info.shard_id
            self._advance()

    def mark(self, shard_id: str, rows: list[int]) -> None:
        before = self.rows.setdefault(shard_id, set())
        new = [row for row in rows if row not in before]
        if len(new) != len(rows):
            raise RuntimeError(f"rows of shard {shard_id} consumed twice: {sorted(set(rows) & before)}")
        before.update(new)
        self.since_publish_rows[shard_id] += len(new)
        self._complete_if_done(shard_id)

    def _complete_if_done(self, shard_id: str) -> None:
        if shard_id in self.num_rows and len(self.rows.get(shard_id, ())) >= self.num_rows[shard_id]:
            self.done.add(shard_id)
            self.since_publish_shards.append(shard_id)
            self.rows.pop(shard_id, None)
            self.num_rows.pop(shard_id)
            self._advance()

    def _advance(self) -> None:
        for worker, shards in self.seen.items():
            while shards and shards[min(shards)] in self.done:
                seq = min(shards)
                self.done.discard(shards.pop(seq))
                self.through[worker] = seq

    def open(self, info: ShardInfo) -> set[int]:
        """Start tracking a shard; returns the rows already consumed before a restart."""
        self.seen.setdefault(info.worker, {})[info.seq] = info.shard_id
        self.num_rows[info.shard_id] = info.num_rows
        already = set(self.rows.get(info.shard_id, ()))
        self._complete_if_done(info.shard_id)
        return already


class Trainer:
    """Continuous trainer over the processed shards of one run.

    Args:
        store: the run's storage; the trainer reads ``shards/processed``, writes
            ``tables/train_steps`` and ``tables/weights`` and publishes weight versions.
        config: :class:`SAOConfig`.
        device: torch device of the policy and value model.
        dtype: parameter dtype of both models; not float16, whose AdamW steps underflow
            (``eps`` 1e-8 is 0 there) and make the parameters NaN at the first step, nor
            bfloat16, where a step of about ``lr`` rounds away on every weight above about
            256·lr: keep float32 and set ``mixed_precision`` for half-precision matmuls.
        temperature: the temperature the rollouts sampled at (the run's ``service.temperature``):
            the engines record log-probs of ``softmax(logits / temperature)``, so the policy's
            log-probs are taken at it too, or every DIS ratio is off even on-policy.

    Raises:
        FileNotFoundError: when the store holds no weight version to start from (publish
            one first, e.g. with ``rl.models.ensure_base_version``).
        ValueError: for float16 or bfloat16 parameters, or a temperature that is not a finite
            number above 0.
    """

    def __init__(
        self,
        store: RunStore,
        config: SAOConfig,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        temperature: float = 1.0,
    ):
        if dtype == torch.float16:
            raise ValueError(
                "float16 parameters cannot be trained with AdamW (its eps underflows and the first step "
                "makes them NaN); keep float32 and set mixed_precision='bf16' for half-precision matmuls"
            )
        if dtype == torch.bfloat16:
            raise ValueError(
                "bfloat16 parameters cannot be trained with AdamW (its step of about lr rounds away on "
                f"every weight above about 256·lr, {256 * config.lr:g} here, so the policy barely moves); "
                "keep float32 and set mixed_precision='bf16' for half-precision matmuls"
            )
        # refused here, not at the first policy step: its critic steps would be taken by then
        check_temperature(temperature)
        self.store = store
        self.config = config
        self.temperature = temperature
        self.device = torch.device(device)
        self.dtype = dtype
        self.weights = WeightStore(store, one_copy=True)
        self.tables = Tables(store)
        self.reader = ShardReader(store, kind="processed")
        self.attempt = uuid.uuid4().hex[:12]
        torch.manual_seed(config.seed)
        self._resume()
        self.buffer: deque[Sample] = deque()
        self.offset = -1
        self.unread: deque[ShardInfo] = deque()
        """Shards polled from the log and not read yet (``read_ahead_batches`` holds them back),
        in the log's order."""
        self.newest_read: dict[str, int] = {}
        """For each worker, the newest sequence number among its shards this trainer has read
        (a processed shard keeps its raw shard's number): the rollout workers' backpressure
        tells from it whether their data has reached the trainer."""
        self._dropped_stale = 0
        self._rejected: Counter = Counter()
        self._stale_since_publish = 0
        self._rejected_since_publish = 0
        self._trained_since_publish = 0
        self._pretrained_since_publish = 0
        """Value pretraining steps since the last version (a stop publishes them)."""
        self._step_extra: Callable[[], dict] | None = None
        self._unwritten_rows: list[dict] = []
        """``train_steps`` rows whose append failed, oldest first: appended with the next row."""
        self.idle_seconds = 0.0
        """Seconds spent in waits for new shards that have ended."""
        self.waiting_since: float | None = None
        """Monotonic time the wait for new shards in progress began (``None``: not waiting)."""
        self._idle_lock = threading.Lock()
        self._failed: NonFinitePolicy | None = None
        """What stopped the trainer for good: every later step or publish raises it again."""

    # -- state ---------------------------------------------------------------------------

    def _resume(self) -> None:
        # a trainer killed between a version's manifest and LATEST left that version
        # complete: resumed from LATEST, its rows would be trained again in another version
        self.weights.recover_latest()
        try:
            version, loaded = self.weights.load_newest("all")
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no weight version in {self.store.url('weights')}: publish a base version first "
                "(rl.models.ensure_base_version)"
            ) from None
        # complete versions newer than the one resumed from, which did not verify: none of
        # this trainer's versions descends from them
        self.passed_over = [v for v in self.weights.list() if v > version]
        if self.passed_over:
            # their rows are in no version this trainer descends from: the next version,
            # whose parent is this one, lists them again, so each is trained once on its chain
            logger.warning(
                "trainer resumes from weight version %d: the newer versions %s do not verify, and "
                "the rows they consumed are trained again",
                version,
                self.passed_over,
            )
        path = Path(loaded)
        self.version = version
        self._chain = self.weights.recent_chain(version, self.config.max_staleness + 1)
        self.policy, self.tokenizer = load_trained_policy(
            str(path), device=str(self.device), dtype=self.dtype
        )
        self.policy.train()
        disable_dropout(self.policy)
        self.vocab_size = self.policy.get_input_embeddings().num_embeddings
        self.tokenizer_fingerprint = self.weights.manifest(version).get("tokenizer_fingerprint")
        self._fingerprints: dict[int, str | None] = {}
        self.pad_id = padding_id(self.tokenizer, self.policy)
        self.policy_optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=self.config.lr, weight_decay=self.config.weight_decay
        )
        self.value_model: ValueModel | None = None
        self.value_optimizer: torch.optim.Optimizer | None = None
        if self.config.mode == "sao":
            self.value_model = placed(ValueModel.from_policy(self.policy), self.device, self.dtype)
            if (path / VALUE_MODEL_FILE).is_file():
                self.value_model.load_state_dict(load_safetensors((path / VALUE_MODEL_FILE).read_bytes()))
            self.value_model.freeze_attention()
            self.value_model.train()
            disable_dropout(self.value_model)
            self.value_optimizer = torch.optim.AdamW(
                [p for p in self.value_model.parameters() if p.requires_grad],
                lr=self.config.value_lr,
                weight_decay=self.config.weight_decay,
            )
            if (path / VALUE_OPTIMIZER_FILE).is_file():
                resume_optimizer(
                    self.value_optimizer,
                    path / VALUE_OPTIMIZER_FILE,
                    self.config.value_lr,
                    self.config.weight_decay,
                )
        if (path / POLICY_OPTIMIZER_FILE).is_file():
            resume_optimizer(
                self.policy_optimizer, path / POLICY_OPTIMIZER_FILE, self.config.lr, self.config.weight_decay
            )
        if self.config.activation_checkpointing:
            for model in (self.policy, self.value_model and self.value_model.backbone):
                if model is not None:
                    enable_activation_checkpointing(model)

        state = json.loads((path / STATE_FILE).read_text()) if (path / STATE_FILE).is_file() else {}
        self.weights.release()  # all of the version is read: its copy need not stay on disk
        self.step = int(state.get("step", self.weights.manifest(version).get("step", 0)))
        self.value_pretrain_done = int(state.get("value_pretrain_done", 0))
        self.consumption = _Consumption(
            through={worker: int(seq) for worker, seq in state.get("consumed_through", {}).items()},
            done=set(state.get("consumed_shards", [])),
            rows={shard: set(rows) for shard, rows in state.get("partial_rows", {}).items()},
        )
        self.shards_id = self.tables.identity("shards")
        """Identity (``Tables.identity``) of the ``shards`` table whose shards the consumption
        marks and the offset name (None: no table yet)."""
        saved_shards_id = state.get("shards_table_id")  # None: saved by an older treadle, unknown
        if saved_shards_id is not None and saved_shards_id != self.shards_id:
            # a recreated table numbers each worker's shards from 0 again, below the old marks
            logger.warning(
                "the shards table was recreated since weight version %d was published (its id was %s, "
                "now %s): the version's consumption marks name the old table's shards, so they are "
                "dropped and every shard of the new table is trained",
                version,
                saved_shards_id,
                self.shards_id or "none, not created yet",
            )
            self.consumption = _Consumption()
        self._steps_since_publish = 0
        # rows recorded before ``WeightStore.record`` existed carry no id that it would find
        recorded = set(self.tables.read("weights").column("version").to_pylist())
        self.recorded_resumed = version not in recorded and self.weights.record(self.tables, version)
        """Whether this trainer wrote the row of the version it resumed from (its publisher
        failed before it, or had not written it yet and then found it written)."""
        if self.recorded_resumed:
            logger.info("recorded weight version %d in the weights table (its row was missing)", version)
        logger.info(
            "trainer resumed from version %d at step %d (attempt %s)", version, self.step, self.attempt
        )

    def staleness(self, min_version: int) -> int:
        """Versions the trainer's policy is ahead of ``min_version``: the newer versions on its
        chain (:func:`storage.weights.versions_ahead`; the difference of the numbers would drop
        as stale samples within ``max_staleness``). Past the part of the chain known
        (``max_staleness + 1`` versions) each number counts."""
        return versions_ahead(self._chain, min_version)

    @staticmethod
    def _torch_bytes(obj: dict) -> bytes:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    def publish(self, before_commit: Callable[[], None] | None = None) -> int:
        """Publish the policy with the trainer's full state; returns the new version.
        ``before_commit`` goes to ``WeightStore.publish``: what it raises leaves the version
        incomplete.

        Raises:
            NonFinitePolicy: when the policy's parameters are not finite (a step made them
                so): nothing is published, and the rows consumed since the last version are
                trained again by a restarted trainer.
        """
        self._check_finite_policy("publishes nothing")
        consumption = self.consumption
        state = {
            "step": self.step,
            "value_pretrain_done": self.value_pretrain_done,
            "consumed_through": dict(sorted(consumption.through.items())),
            "consumed_shards": sorted(consumption.done),
            "partial_rows": {shard: sorted(rows) for shard, rows in consumption.rows.items()},
            "shards_table_id": self.shards_id,
        }
        extra = {
            STATE_FILE: json.dumps(state).encode(),
            POLICY_OPTIMIZER_FILE: self._torch_bytes(self.policy_optimizer.state_dict()),
        }
        if self.value_model is not None and self.value_optimizer is not None:
            value_state = {
                name: t.detach().cpu().contiguous() for name, t in self.value_model.state_dict().items()
            }
            extra[VALUE_MODEL_FILE] = save_safetensors(value_state)
            extra[VALUE_OPTIMIZER_FILE] = self._torch_bytes(self.value_optimizer.state_dict())
        metadata = {
            "consumed_shards": list(consumption.since_publish_shards),
            "consumed_rows": dict(consumption.since_publish_rows),
            "trained_samples": self._trained_since_publish,
            "dropped_stale": self._stale_since_publish,
            "rejected_rows": self._rejected_since_publish,
            "attempt": self.attempt,
        }
        parent = self.version
        version = publish_policy(
            self.weights,
            self.policy,
            self.tokenizer,
            self.config.publish_dtype,
            step=self.step,
            parent=parent,
            metadata=metadata,
            extra_files=extra,
            before_commit=before_commit,
        )
        # the trainer is on the new version before anything else can fail: a trainer that goes
        # on after a failed row append trains from it (a resumed trainer writes the row)
        self.version = version
        self._chain = [*self._chain, version][-(self.config.max_staleness + 1) :]
        consumed_shards = len(consumption.since_publish_shards)
        consumption.since_publish_shards = []
        consumption.since_publish_rows = Counter()
        self._steps_since_publish = 0
        self._stale_since_publish = self._rejected_since_publish = self._trained_since_publish = 0
        self._pretrained_since_publish = 0
        self.weights.record(self.tables, version)
        if self.config.keep_versions is not None:
            try:
                removed = self.weights.retain(self.config.keep_versions, verified=version)
            except Exception as exc:  # the version is published; the next publish retries
                logger.warning("could not delete old weight versions after version %d: %s", version, exc)
            else:
                if removed:
                    logger.info(
                        "deleted weight versions %s (keep_versions=%d)", removed, self.config.keep_versions
                    )
        logger.info(
            "published version %d at step %d (%d shards consumed since version %d)",
            version,
            self.step,
            consumed_shards,
            parent,
        )
        return version

    # -- data ----------------------------------------------------------------------------

    def ingest(self) -> int:
        """Poll the processed-shard log and buffer the rows of the shards polled, until the
        buffer holds ``read_ahead_batches`` steps' worth of tokens; returns new shards read.

        A shard is let go of only once read: when a read raises (a transient storage error),
        the next call meets it again. Let go of first, a trainer that went on would never read
        it, and its worker's mark, passing over numbers it never met, would count it consumed.
        """
        if self.shards_id is None:  # none yet when this trainer resumed
            self.shards_id = self.tables.identity("shards")
        # a table recreated under this trainer raises (StaleOffsetError) rather than pass its
        # first versions over
        infos, self.offset = self.reader.poll(self.offset, self.shards_id)
        # by number, which ShardReader.poll gives already: the marks rely on it, so the trainer
        # does not leave it to the reader
        self.unread.extend(sorted(infos, key=lambda info: info.seq))
        limit = self.config.read_ahead_batches * self.config.token_budget
        read = 0
        newest = dict(self.newest_read)
        while self.unread and self.buffered_tokens() < limit:
            info = self.unread[0]
            if info.shard_id in self.consumption.num_rows:
                pass
            elif self.consumption.consumed(info):
                self.consumption.saw(info)
            else:
                try:
                    self._ingest_shard(info)
                except BaseException:
                    # not in flight: the next call reads it again (rows it rejected stay marked)
                    self.consumption.num_rows.pop(info.shard_id, None)
                    raise
                read += 1
            self.unread.popleft()
            newest[info.worker] = max(info.seq, newest.get(info.worker, -1))
        # after the rows are buffered, so that a status never shows a shard read and its
        # rows missing; replaced whole, as the status thread reads it
        self.newest_read = newest
        return read

    def _ingest_shard(self, info: ShardInfo) -> None:
        already = self.consumption.open(info)
        if self.consumption.consumed(info):
            return
        foreign = self._foreign_tokenizer({info.min_version, info.max_version})
        table = None
        if foreign is None:
            table = self.reader.read(info)
            # a run that changed its tokenizer and back has versions of another between the two
            foreign = None if table is None else self._foreign_tokenizer(generated_versions(table))
        if foreign is not None:
            logger.warning("rejected shard %s: %s", info.shard_id, foreign)
            self._reject(info.shard_id, [r for r in range(info.num_rows) if r not in already], foreign)
            return
        if table is None:
            reason = f"shard {self.reader.unread_reason(info)}"
            self._reject(info.shard_id, [r for r in range(info.num_rows) if r not in already], reason)
            return
        samples, rejected = samples_from_table(table, info.shard_id, self.vocab_size)
        by_reason: dict[str, list[int]] = {}
        for row, trajectory_id, reason in rejected:
            if row not in already:
                logger.warning("rejected trajectory %s of shard %s: %s", trajectory_id, info.shard_id, reason)
                by_reason.setdefault(reason, []).append(row)
        for reason, rows in by_reason.items():
            self._reject(info.shard_id, rows, reason)
        self.buffer.extend(s for s in samples if s.row not in already)

    def _foreign_tokenizer(self, versions: set[int]) -> str | None:
        """Why tokens generated by the weight ``versions`` (−1: none) cannot be in the policy's
        vocabulary, judged by those versions' tokenizers (None when they match or are unknown)."""
        if self.tokenizer_fingerprint is None:
            return None
        for version in sorted(versions - {-1}):
            if version not in self._fingerprints:
                try:
                    self._fingerprints[version] = self.weights.manifest(version).get("tokenizer_fingerprint")
                except (KeyError, CorruptVersion):  # pruned, or never in this store
                    self._fingerprints[version] = None
            theirs = self._fingerprints[version]
            if theirs is not None and theirs != self.tokenizer_fingerprint:
                return (
                    f"generated by weight version {version}, whose tokenizer's vocabulary differs from "
                    "the policy's: shard from another tokenizer"
                )
        return None

    def _reject(self, shard_id: str, rows: list[int], reason: str) -> None:
        self._rejected[reason] += len(rows)
        self._rejected_since_publish += len(rows)
        self.consumption.mark(shard_id, rows)

    def drop_stale(self) -> int:
        """Drop buffered samples older than ``max_staleness`` versions; returns how many.
        In GRPO mode a group goes whole when any member is stale: its advantages are taken
        over the whole group."""
        limit = self.config.max_staleness
        stale = {id(s) for s in self.buffer if self.staleness(s.min_version) > limit}
        if self._keep_groups:
            groups = {s.group_id for s in self.buffer if id(s) in stale and s.group_id is not None}
            stale |= {id(s) for s in self.buffer if s.group_id in groups}
        keep: deque[Sample] = deque()
        dropped: list[Sample] = []
        for sample in self.buffer:
            (dropped if id(sample) in stale else keep).append(sample)
        self.buffer = keep
        for sample in dropped:
            self.consumption.mark(sample.shard_id, [sample.row])
        self._dropped_stale += len(dropped)
        self._stale_since_publish += len(dropped)
        return len(dropped)

    def buffered_tokens(self) -> int:
        """Tokens of the samples waiting in the buffer (safe to call from another thread)."""
        # tuple() copies the deque in one C call, so the training thread cannot change it mid-sum
        return sum(sample.num_tokens for sample in tuple(self.buffer))

    def buffered_samples(self) -> int:
        """Samples (trajectories) waiting in the buffer (safe to call from another thread)."""
        return len(tuple(self.buffer))

    def _unread_to_train(self) -> list[ShardInfo]:
        """The shards not read yet, less those consumed already: a restarted trainer polls the
        whole log, and the consumed shards numbered above the first it reads wait in ``unread``
        until the read-ahead reaches them (safe to call from another thread)."""
        return [info for info in tuple(self.unread) if not self.consumption.consumed(info)]

    def queued_tokens(self) -> int:
        """Tokens waiting to be trained: the buffer's and those of the shards not read yet (as
        their commits count them; safe to call from another thread)."""
        return self.buffered_tokens() + sum(info.num_tokens for info in self._unread_to_train())

    def queued_samples(self) -> int:
        """Trajectories waiting to be trained: the buffer's and the rows of the shards not read
        yet (safe to call from another thread)."""
        return self.buffered_samples() + sum(info.num_rows for info in self._unread_to_train())

    def idle_seconds_at(self, now: float) -> float:
        """Seconds waited for new shards up to monotonic time ``now``, the wait in progress
        included (safe from another thread): a poll wait lasts up to ``poll_seconds``."""
        with self._idle_lock:
            waiting = 0.0 if self.waiting_since is None else max(now - self.waiting_since, 0.0)
            return self.idle_seconds + waiting

    def unconsumed_shards(self) -> int:
        """Shards whose rows wait in the buffer, and those not read yet (safe from another thread)."""
        unread = {info.shard_id for info in self._unread_to_train()}
        return len({sample.shard_id for sample in tuple(self.buffer)} | unread)

    # -- the loop ------------------------------------------------------------------------

    def run(
        self,
        *,
        max_steps: int | None = None,
        max_seconds: float | None = None,
        stop_event: threading.Event | None = None,
        progress: Callable[[dict], None] | None = None,
        drain: bool = False,
        drain_event: threading.Event | None = None,
        step_extra: Callable[[], dict] | None = None,
        role: HeldRole | None = None,
        on_publish: Callable[[int], None] | None = None,
    ) -> TrainSummary:
        """Train until a stop condition holds.

        Args:
            max_steps: stop once the (resumed) policy step counter reaches this.
            max_seconds: stop after this much wall-clock time in this call.
            stop_event: stop when it is set (checked between steps and while idle).
            progress: called with each step's ``train_steps`` row (``extra`` as a dict).
            drain: also stop when the shard log has nothing new and the buffer is empty;
                a last partial batch is trained instead of waiting for more data.
            drain_event: drain from the moment it is set (the producers have finished).
            step_extra: called before each step's row is written; what it returns is merged
                into the row's ``extra`` (e.g. the elastic controller's inputs and moves); when
                it raises or returns no mapping JSON can hold, the row goes without and the
                training goes on.
            role: the run's trainer role, held by this trainer: it is read back before each
                publish and again once the version's files are uploaded, just before its
                manifest makes it complete, and once it is lost (``role.lost``) the trainer
                stops and publishes nothing more (another trainer took the run and trains
                from its latest version: what this one trained since is left to it).
            on_publish: called with each version this call publishes, once it is published
                (before the trainer goes on: a failure later in the call cannot lose it).

        On a clean stop the steps since the last version are published
        (``publish_on_stop``).
        """
        stop_event = stop_event or threading.Event()
        if max_steps is not None and self.step >= max_steps:
            logger.warning(
                "the run is already at policy step %d, at or past max_steps=%d (steps count over the "
                "whole run, earlier flow runs included): nothing to train",
                self.step,
                max_steps,
            )
        self._step_extra = step_extra
        started = time.monotonic()
        versions: list[int] = []

        def stop_reason_now() -> str | None:
            """Why the loop stops between steps now, or None to go on."""
            if role is not None and role.lost.is_set():
                return "abandoned"
            if max_steps is not None and self.step >= max_steps:
                return "max_steps"
            # before the event: a deadline that passed during a step is why the run ends, even
            # when a stop the same deadline caused elsewhere (the pipeline's) arrived meanwhile
            if max_seconds is not None and time.monotonic() - started >= max_seconds:
                return "max_seconds"
            if stop_event.is_set():
                return "stop_event"
            return None

        def stopping() -> bool:
            return stop_reason_now() is not None

        while True:
            stop_reason = stop_reason_now()
            if stop_reason is not None:
                break
            draining = drain or (drain_event is not None and drain_event.is_set())
            try:
                new_shards = self.ingest()
            except Exception:
                # a shard of a newer treadle stops the run until treadle is upgraded, a storage
                # error (a poll or a fetch that timed out) until the task's retry resumes from
                # LATEST: what it trained so far is kept either way
                self._publish_before_failing(on_publish, role)
                raise
            self.drop_stale()
            # shards held back by the read-ahead are data still to read, whatever this poll read
            nothing_new = new_shards == 0 and not self.unread
            full = self.buffered_tokens() >= self.config.token_budget
            if full or (draining and nothing_new and self.buffer):
                self._pretrain_value(stopping)
                if stopping():  # the loop's next check says which
                    continue
                metrics = self._train_step(
                    take_batch(self.buffer, self.config.token_budget, self._keep_groups)
                )
                if progress is not None and metrics is not None:
                    progress({**metrics.row, "extra": metrics.extra})
                if self._publishes_now():
                    version = self._publish_and_tell(on_publish, role)
                    if version is not None:
                        versions.append(version)
                continue
            if draining and nothing_new:
                stop_reason = "drained"
                break
            if nothing_new:
                waited = time.monotonic()
                wait = self.config.poll_seconds
                if max_seconds is not None:  # never sleep past the deadline
                    wait = min(wait, max(max_seconds - (waited - started), 0.0))
                with self._idle_lock:
                    self.waiting_since = waited
                stop_event.wait(wait)
                with self._idle_lock:
                    self.idle_seconds += time.monotonic() - waited
                    self.waiting_since = None
        if stop_reason != "abandoned":
            self._flush_unwritten_rows()
        if stop_reason != "abandoned" and self._publishes_at_stop():
            version = self._publish_and_tell(on_publish, role)
            if version is None:
                stop_reason = "abandoned"
            else:
                versions.append(version)
        logger.info("trainer stopped (%s) at step %d", stop_reason, self.step)
        return TrainSummary(steps=self.step, versions=versions, stop_reason=stop_reason)

    def _publish_and_tell(
        self, on_publish: Callable[[int], None] | None, role: HeldRole | None
    ) -> int | None:
        """Publish and tell ``on_publish``; None, with nothing published, when ``role`` is
        found lost before the upload or before the manifest.

        What remains is the manifest's own write: a new holder's status that lands after the
        read-back is not seen, and the version still completes. It races the new holder only
        if that one write outlasts the holder's claim and model load (it resumes from the
        newest complete version after them); neither ``O_EXCL`` nor a conditional PUT makes a
        write depend on another object, so the store cannot close it."""
        if role is not None and not role.holds():
            return None
        try:
            version = self.publish(before_commit=None if role is None else role.require)
        except InUse:
            return None
        if on_publish is not None:
            on_publish(version)
        return version

    def _publish_before_failing(
        self, on_publish: Callable[[int], None] | None, role: HeldRole | None
    ) -> None:
        """As a clean stop does (``publish_on_stop``), before the run fails on data this
        treadle cannot read or on a storage error reading it: the steps since the last version
        would be lost with it, a whole night's for a run that publishes only at its stop. What
        fails here is logged, so that the error the run fails with stays the first one."""
        try:
            self._flush_unwritten_rows()
            if self._publishes_at_stop():
                self._publish_and_tell(on_publish, role)
        except Exception as exc:
            logger.error("could not publish what was trained before the run failed: %s", exc)

    def _publishes_now(self) -> bool:
        every = self.config.publish_every
        return every is not None and self._steps_since_publish >= every

    def _publishes_at_stop(self) -> bool:
        """Whether a stop publishes: ``publish_on_stop``, and steps (policy or value pretraining)
        or consumption since the last version."""
        return self.config.publish_on_stop and bool(
            self._steps_since_publish or self._pretrained_since_publish or self._pending_consumption()
        )

    def _pending_consumption(self) -> bool:
        return bool(
            self.consumption.since_publish_shards or sum(self.consumption.since_publish_rows.values())
        )

    @property
    def _keep_groups(self) -> bool:
        return self.config.mode == "grpo"

    def _pretrain_value(self, stopping: Callable[[], bool] = lambda: False) -> None:
        """Critic-only steps over the buffered batches before the first policy step.

        The batches are not consumed: their policy step comes after. Once ``stopping()`` holds
        no further step is taken (those of a large critic take minutes); the steps taken are
        published by the stop, and the rest are taken by the trainer that resumes.
        """
        if self.value_model is None or self.value_pretrain_done >= self.config.value_pretrain_steps:
            return
        pending = list(self.buffer)
        batches: list[list[Sample]] = []
        while pending:
            queue = deque(pending)
            batches.append(take_batch(queue, self.config.token_budget))
            pending = list(queue)
        losses = []
        attempts = skipped_in_a_row = 0
        # a step the critic skips (non-finite loss or gradient norm) does not count; once every
        # batch skipped in a row, the rest waits for the next policy step's buffer
        while (
            self.value_pretrain_done < self.config.value_pretrain_steps
            and skipped_in_a_row < len(batches)
            and not stopping()
        ):
            parts = self._parts(batches[attempts % len(batches)])
            attempts += 1
            stats = self._value_step(parts, self._old_values(parts))
            if stats is None:
                skipped_in_a_row += 1
                continue
            skipped_in_a_row = 0
            losses.append(stats["value_loss"])
            self.value_pretrain_done += 1
            self._pretrained_since_publish += 1
        if losses:
            logger.info("value pretraining: %d steps, loss %.4f -> %.4f", len(losses), losses[0], losses[-1])
        if self.value_pretrain_done < self.config.value_pretrain_steps and skipped_in_a_row == len(batches):
            logger.warning(
                "value pretraining: every buffered batch gives a non-finite critic loss or gradient norm; "
                "%d of %d steps done, the rest are tried before the next policy step",
                self.value_pretrain_done,
                self.config.value_pretrain_steps,
            )

    def _parts(self, samples: list[Sample]) -> list[Batch]:
        return [
            pad_batch(part, self.pad_id).to(self.device)
            for part in micro_batches(samples, self.config.micro_token_budget)
        ]

    # -- one step ------------------------------------------------------------------------

    def _old_values(self, parts: list[Batch]) -> list[torch.Tensor] | None:
        if self.config.value_clip is None:
            return None
        with torch.no_grad(), self._autocast():
            return [token_values(self.value_model, p.input_ids, p.attention_mask) for p in parts]

    def _value_step(
        self, parts: list[Batch], old_values: list[torch.Tensor] | None
    ) -> dict[str, float] | None:
        """One critic step on GAE targets (λ = ``value_lam``) from its own current values, over
        every action token: a shared prefix, trained once by the policy (``train_mask``), is
        fitted to the return of each branch that holds it. Returns its ``value_loss``,
        ``explained_variance`` and ``grad_norm`` (before clipping, as the policy step's).

        With a non-finite loss or gradient norm (a reward too large for float32 arithmetic)
        no step is taken and None is returned: a step on it would make the critic NaN, and
        every later batch's advantages with it."""
        config = self.config
        total_actions = sum(int(p.action_mask.sum()) for p in parts)
        self.value_optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        scored_values, scored_returns = [], []
        for i, part in enumerate(parts):
            with self._autocast():
                values = token_values(self.value_model, part.input_ids, part.attention_mask)
            _, returns = skip_observation_gae(
                part.rewards, values.detach(), part.action_mask, config.gamma, config.value_lam
            )
            loss, stats = value_loss(
                values,
                returns,
                part.action_mask,
                None if old_values is None else old_values[i],
                config.value_clip,
            )
            share = int(part.action_mask.sum()) / max(total_actions, 1)
            (loss * share).backward()
            loss_total += stats["value_loss"] * share
            scored_values.append(values.detach()[part.action_mask])
            scored_returns.append(returns[part.action_mask])
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.value_model.parameters(), config.max_grad_norm))
        if not (math.isfinite(loss_total) and math.isfinite(grad_norm)):
            self.value_optimizer.zero_grad(set_to_none=True)
            return None
        self.value_optimizer.step()
        # over the whole batch: a mean of the parts' ratios would change with the micro-batching
        explained = explained_variance(torch.cat(scored_values), torch.cat(scored_returns))
        return {"value_loss": loss_total, "explained_variance": explained, "grad_norm": grad_norm}

    def _advantages(self, parts: list[Batch], samples: list[Sample]) -> list[torch.Tensor]:
        config = self.config
        if config.mode == "grpo":
            # each execution counts once in its group, its rows by their share of its loss weight
            rows = group_advantages(
                torch.tensor([s.reward for s in samples]),
                [s.group_id if s.group_id is not None else s.trajectory_id for s in samples],
                normalize_std=config.grpo_normalize_std,
                execution_ids=[s.execution_id for s in samples],
                weights=torch.tensor([float(s.loss_weight[s.train_mask].sum()) for s in samples]),
            ).to(self.device)
            out, start = [], 0
            for part in parts:
                rows_here = rows[start : start + part.input_ids.shape[0]]
                start += part.input_ids.shape[0]
                out.append(
                    torch.where(part.action_mask, rows_here[:, None], torch.zeros_like(part.rollout_logprobs))
                )
            return out
        out = []
        with torch.no_grad():
            for part in parts:
                with self._autocast():
                    values = token_values(self.value_model, part.input_ids, part.attention_mask)
                lam = (
                    adaptive_lambda(part.action_mask.sum(dim=1), config.lambda_alpha)
                    if config.adaptive_lambda
                    else config.lam
                )
                advantages, _ = skip_observation_gae(
                    part.rewards, values, part.action_mask, config.gamma, lam
                )
                out.append(advantages)
        return out

    def _autocast(self) -> torch.autocast:
        """Where the models' forward passes run: bfloat16 matmuls under ``mixed_precision: bf16``."""
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.config.mixed_precision == "bf16"
        )

    def _non_finite_parameter(self) -> str | None:
        """The name of a policy parameter holding a NaN or an infinity, or None (one pass over
        the weights and one device sync, far cheaper than a forward pass over the batch)."""
        named = list(self.policy.named_parameters())
        finite = torch.stack([torch.isfinite(p).all() for _, p in named])
        if bool(finite.all()):
            return None
        return named[int((~finite).nonzero()[0, 0])][0]

    def _check_finite_policy(self, what: str) -> None:
        """Raise :class:`NonFinitePolicy` when the trainer failed so before, or when a policy
        parameter is not finite; ``what`` says what the trainer does not do then."""
        if self._failed is not None:
            raise self._failed
        name = self._non_finite_parameter()
        if name is not None:
            self._fail(
                f"the policy's parameter {name} holds a NaN or an infinity at step {self.step}, "
                f"{self._steps_since_publish} steps after weight version {self.version}: the trainer "
                f"stops and {what}. A restarted trainer resumes from version {self.version} and trains "
                "the rows consumed since again; if that version's own weights are not finite, no "
                "trainer can train from it"
            )

    def _fail(self, message: str) -> NoReturn:
        self._failed = NonFinitePolicy(message)
        # the trainer takes no step after this one, whose append would take them along
        self._flush_unwritten_rows()
        raise self._failed

    def _train_step(self, samples: list[Sample]) -> StepMetrics | None:
        """K critic steps, advantages with the updated critic, one DIS policy step.

        The policy loss is Σ w·loss over the batch's trained tokens divided by their Σ w (the
        processor's ``loss_weight``): with each execution's weights summing to 1, the mean over
        the batch's executions of their token means; with every weight 1, the plain token mean.

        A batch with no trainable token (or none of positive weight) is rejected before any
        update. A critic step with a non-finite loss or gradient norm (a reward too large for
        float32 arithmetic) rejects the batch before the policy step, without that critic
        step. In GRPO a non-finite policy loss or gradient norm rejects the batch too, no
        model having moved on it. A batch that gives the policy a zero gradient is trained
        without its optimizer step.

        Raises:
            NonFinitePolicy: before any update, when a policy parameter is not finite; in SAO,
                when the policy loss or its gradient norm is not finite: the critic has taken
                its K steps on the batch by then (undoing them would need a copy of its state
                at every step), so the batch is not refused but the trainer stops, with the
                steps in memory only.
        """
        config = self.config
        self._check_finite_policy("consumes nothing more")
        started = time.perf_counter()
        parts = self._parts(samples)
        total_train = sum(int(p.train_mask.sum()) for p in parts)
        if total_train == 0:
            self._reject_batch(samples, "all-masked batch: no trainable tokens")
            return None
        total_weight = sum(float(p.loss_weight[p.train_mask].sum()) for p in parts)
        if total_weight <= 0:
            self._reject_batch(samples, "every trainable token has loss weight 0")
            return None

        value_stats = []
        if self.value_model is not None:
            old_values = self._old_values(parts)
            for _ in range(config.value_steps):
                stats = self._value_step(parts, old_values)
                if stats is None:
                    self._reject_batch(samples, NON_FINITE_CRITIC)
                    return None
                value_stats.append(stats)
        advantages = self._advantages(parts, samples)
        if config.normalize_advantages:
            flat = torch.cat([a[p.train_mask] for a, p in zip(advantages, parts, strict=True)])
            if bool(flat.min() == flat.max()):
                # equal advantages carry no signal; their float mean can miss them by an ulp,
                # which a std of that ulp would blow up to advantages near ±1
                advantages = [torch.zeros_like(a) for a in advantages]
            else:
                mean, std = flat.mean(), flat.std()
                advantages = [
                    (a - mean) / (std + 1e-8) * p.action_mask for a, p in zip(advantages, parts, strict=True)
                ]

        self.policy_optimizer.zero_grad(set_to_none=True)
        policy_loss = 0.0
        weighted: Counter = Counter()
        for part, part_advantages in zip(parts, advantages, strict=True):
            with self._autocast():
                logprobs = token_logprobs(
                    self.policy,
                    part.input_ids,
                    part.attention_mask,
                    where=part.train_mask,
                    temperature=self.temperature,
                )
            loss, stats = dis_policy_loss(
                logprobs,
                part.rollout_logprobs,
                part_advantages,
                part.train_mask,
                config.eps_low,
                config.eps_high,
                loss_weight=part.loss_weight,
            )
            # dis_policy_loss divides this part's Σ w·loss by its token count
            (loss * (stats["num_tokens"] / total_weight)).backward()
            policy_loss += float(loss.detach()) * stats["num_tokens"] / total_weight
            share = stats["num_tokens"] / total_train
            for name in ("masked_fraction", "masked_low", "masked_high", "mean_ratio", "kl"):
                weighted[name] += stats[name] * share
            weighted["max_ratio"] = max(weighted["max_ratio"], stats["max_ratio"])
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), config.max_grad_norm))
        if not (math.isfinite(policy_loss) and math.isfinite(grad_norm)):
            self.policy_optimizer.zero_grad(set_to_none=True)
            reason = f"non-finite policy loss {policy_loss} or gradient norm {grad_norm}"
            if self.value_model is None:
                self._reject_batch(samples, reason)
                return None
            self._fail(
                f"{reason} at step {self.step + 1}, {self._steps_since_publish} steps after weight version "
                f"{self.version}, on a batch of {len(samples)} samples (shards "
                f"{sorted({s.shard_id for s in samples})}) the critic took its steps on: the trainer stops "
                f"without consuming it or publishing. A restarted trainer resumes both models from version "
                f"{self.version} and trains the rows consumed since again (and meets these shards again, "
                "should their rewards or loss weights be what overflows)"
            )
        # a batch with no gradient (every trained token outside the DIS interval, every
        # advantage 0) leaves the policy as it is: AdamW would still move every weight by its
        # momentum and weight decay
        if grad_norm > 0:
            self.policy_optimizer.step()

        self.step += 1
        self._steps_since_publish += 1
        self._trained_since_publish += len(samples)
        for sample in samples:
            self.consumption.mark(sample.shard_id, [sample.row])
        seconds = time.perf_counter() - started
        staleness = [self.staleness(s.min_version) for s in samples]
        num_tokens = sum(s.num_tokens for s in samples)
        flat_adv = torch.cat([a[p.train_mask] for a, p in zip(advantages, parts, strict=True)])
        extra = {
            "attempt": self.attempt,
            "mode": config.mode,
            "staleness_hist": {str(k): v for k, v in sorted(Counter(staleness).items())},
            "value_losses": [s["value_loss"] for s in value_stats],
            "value_grad_norms": [s["grad_norm"] for s in value_stats],
            "explained_variance": value_stats[-1]["explained_variance"] if value_stats else None,
            "masked_low": weighted["masked_low"],
            "masked_high": weighted["masked_high"],
            "max_ratio": weighted["max_ratio"],
            "advantage_mean": float(flat_adv.mean()),
            "advantage_std": float(flat_adv.std()) if flat_adv.numel() > 1 else 0.0,
            "grad_norm": grad_norm,
            "train_tokens": total_train,
            "rejected": dict(self._rejected),
        }
        extra.update(self._step_extra_fields())
        row = {
            "step": self.step,
            "version": self.version,
            "policy_loss": policy_loss,
            "value_loss": value_stats[-1]["value_loss"] if value_stats else None,
            "masked_fraction": weighted["masked_fraction"],
            "mean_ratio": weighted["mean_ratio"],
            "kl": weighted["kl"],
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "num_samples": len(samples),
            "num_tokens": num_tokens,
            "tokens_per_s": num_tokens / max(seconds, 1e-9),
            "reward_mean": execution_mean_reward(samples),
            "dropped_stale": self._dropped_stale,
            "step_seconds": seconds,
            "time": datetime.now(UTC),
            "extra": json.dumps(extra),
            "trajectory_ids": [s.trajectory_id for s in samples],
        }
        self._log_step(row)
        self._dropped_stale = 0
        self._rejected = Counter()
        return StepMetrics(row=row, extra=extra)

    def _step_extra_fields(self) -> dict:
        """What ``step_extra`` adds to the step's ``extra``; nothing when it raises or returns
        what is no mapping JSON can hold (the step is taken already: a failure of its metrics
        must not stop the training)."""
        if self._step_extra is None:
            return {}
        try:
            fields = self._step_extra()
            if not isinstance(fields, dict):
                raise TypeError(f"it returned a {type(fields).__name__}, not a dict")
            json.dumps(fields)
            return fields
        except Exception as exc:
            logger.warning("step %d: step_extra failed, its train_steps row goes without: %r", self.step, exc)
            return {}

    def _log_step(self, row: dict) -> None:
        """Append ``row`` to ``train_steps``, after the rows of earlier steps whose append failed.

        A failure is logged, not raised: the step is taken and its rows marked consumed, so
        the trainer goes on (the rows go into the next published version as usual) and keeps
        the rows to append with the next one, or as it stops (:meth:`_flush_unwritten_rows`).
        An append that raised although its commit landed makes a row twice, which
        :func:`~storage.tables.one_row_per_step` reads once.
        """
        try:
            conform("train_steps", [row])
        except SchemaError as exc:  # it would fail every later append it went with
            logger.warning("step %d: its train_steps row is dropped: %s", row["step"], exc)
            rows = self._unwritten_rows
        else:
            rows = [*self._unwritten_rows, row]
        if not rows:
            return
        try:
            self.tables.append("train_steps", rows)
        except Exception as exc:
            kept = rows[-MAX_UNWRITTEN_ROWS:]
            logger.warning(
                "could not append %d train_steps rows (steps %d to %d), kept for the next step's "
                "append (%d dropped): %r",
                len(rows),
                rows[0]["step"],
                rows[-1]["step"],
                len(rows) - len(kept),
                exc,
            )
            self._unwritten_rows = kept
        else:
            self._unwritten_rows = []

    def _flush_unwritten_rows(self) -> None:
        """Append the ``train_steps`` rows whose append failed, as the trainer stops (or fails,
        :meth:`_fail`): no later step's append takes them. One more failure is logged and they
        are lost."""
        rows, self._unwritten_rows = self._unwritten_rows, []
        if not rows:
            return
        try:
            self.tables.append("train_steps", rows)
        except Exception as exc:
            logger.warning(
                "could not append %d train_steps rows (steps %d to %d) as the trainer stops; they are lost: %r",
                len(rows),
                rows[0]["step"],
                rows[-1]["step"],
                exc,
            )

    def _reject_batch(self, samples: list[Sample], reason: str) -> None:
        logger.warning("rejected a batch of %d samples: %s", len(samples), reason)
        for sample in samples:
            self._reject(sample.shard_id, [sample.row], reason)
