"""Trajectory processor: prefix-tree reconstruction, dedup, partial progress, weights.

Checked against slow references written out here: sets of token-prefix tuples for "the same
token", a tree walk for common prefixes, and a per-token weighted loss on the original
batch for the gradient.
"""

from __future__ import annotations

import gc
import random
from collections import Counter, defaultdict
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl.batching import micro_batches, pad_batch, samples_from_table
from rl.logprobs import token_logprobs
from rl.models import TinyModelConfig, build_tiny_model
from rl.prefix_tree import path_symbols, select_paths, sorted_paths, tree_from_parents, tree_from_tokens
from rl.processor import ProcessorConfig, combine_reward, process_shard
from storage.schema import PROCESSED_SCHEMA, TOKEN_COLUMNS, TRAJECTORY_SCHEMA, to_table, validate

TRAJECTORY_COLUMNS = {
    "trajectory_id",
    "execution_id",
    "parent_id",
    "task",
    "prompt_id",
    "group_id",
    "shard_id",
    "reward",
    "progress",
    "status",
    "num_tokens",
    "num_action_tokens",
    "num_train_tokens",
    "num_turns",
    "min_version",
    "max_version",
    "selected",
    "drop_reason",
    "text",
    "engine",
    "processed_at",
    "error",
}


def record(tid, eid, tokens, mask, *, parent=None, branch_at=None, reward=1.0, progress=None, status="ok"):
    """One raw trajectory record with consistent per-token columns."""
    tokens = [int(t) for t in tokens]
    mask = [bool(m) for m in mask]
    turn, current = [], 0
    for k, m in enumerate(mask):
        if k and m and not mask[k - 1]:
            current += 1
        turn.append(current)
    return {
        "trajectory_id": tid,
        "execution_id": eid,
        "parent_id": parent,
        "branch_at": branch_at,
        "task": "toy",
        "prompt_id": f"prompt-{eid}",
        "tokens": tokens,
        "logprobs": [-0.5 if m else 0.0 for m in mask],
        "action_mask": mask,
        "turn": turn,
        "versions": [3 if m else -1 for m in mask],
        "reward": reward,
        "progress": progress,
        "status": status,
        "engine": "torch-0",
    }


def random_execution(
    rng, eid, n_paths, *, vocab=8, fresh_from=1000, max_len=30, p_retry=0.2, p_null_branch=0.2
):
    """A random branching execution: a root, branches at random points of random earlier
    paths (the token at the branch point is fresh, so the branch really diverges), and
    exact retries. Position 0 is never an action token (a rollout starts with its prompt).
    Returns records with parent_id/branch_at set."""
    fresh = iter(range(fresh_from, fresh_from + 10_000))

    def tail(length):
        toks = rng.integers(0, vocab, length).tolist()
        mask = (rng.random(length) < 0.6).tolist()
        return toks, mask

    length = int(rng.integers(1, max_len))
    prompt = int(rng.integers(1, length + 1))
    toks, mask = tail(length)
    mask[:prompt] = [False] * prompt
    paths = [(toks, mask)]
    records = [record(f"{eid}-0", eid, toks, mask, reward=float(rng.random()))]
    for k in range(1, n_paths):
        p = int(rng.integers(0, len(paths)))
        ptoks, pmask = paths[p]
        if rng.random() < p_retry:
            toks, mask, at = list(ptoks), list(pmask), len(ptoks)
        else:
            at = int(rng.integers(0, len(ptoks) + 1))
            extra_toks, extra_mask = tail(int(rng.integers(0, max_len)))
            toks = ptoks[:at] + [next(fresh)] + extra_toks
            mask = pmask[:at] + [bool(rng.random() < 0.6) and at > 0] + extra_mask
        declared = None if rng.random() < p_null_branch else at
        paths.append((toks, mask))
        records.append(record(f"{eid}-{k}", eid, toks, mask, parent=f"{eid}-{p}", branch_at=declared))
        records[-1]["reward"] = float(rng.random())
    return records


def random_shard(seed, n_executions, max_paths, **kwargs):
    rng = np.random.default_rng(seed)
    records = []
    for e in range(n_executions):
        records += random_execution(rng, f"e{e}", int(rng.integers(1, max_paths + 1)), **kwargs)
    rng.shuffle(records)
    return records


def symbols_of(row, mask_key="action_mask"):
    return list(zip(row["tokens"], row[mask_key], strict=True))


def trainable_nodes(records):
    """Slow reference: the distinct trainable tokens, as (execution, whole prefix) keys."""
    nodes = set()
    for row in records:
        sym = symbols_of(row)
        for p, (_, is_action) in enumerate(sym):
            if is_action:
                nodes.add((row["execution_id"], tuple(sym[: p + 1])))
    return nodes


def trained_nodes(processed):
    """Every trained token of the processed rows, as (execution, whole prefix) keys."""
    out = []
    for row in processed.to_pylist():
        sym = symbols_of(row)
        for p, trained in enumerate(row["train_mask"]):
            if trained:
                out.append((row["execution_id"], tuple(sym[: p + 1])))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_executions=st.integers(1, 4), max_paths=st.integers(1, 9))
def test_unlimited_j_max_trains_every_distinct_trainable_token_exactly_once(seed, n_executions, max_paths):
    records = random_shard(seed, n_executions, max_paths)
    result = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s0")
    trained = Counter(trained_nodes(result.processed))
    assert set(trained) == trainable_nodes(records)
    assert all(count == 1 for count in trained.values())
    assert result.counters.train_tokens_out == len(trainable_nodes(records))
    validate(result.processed)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_executions=st.integers(1, 4),
    max_paths=st.integers(1, 12),
    j_max=st.integers(1, 4),
)
def test_bounded_selection_never_trains_twice_nor_outside_actions(seed, n_executions, max_paths, j_max):
    records = random_shard(seed, n_executions, max_paths)
    result = process_shard(to_table(records), ProcessorConfig(j_max=j_max, seed=seed), shard_id="s0")
    trained = Counter(trained_nodes(result.processed))
    assert all(count == 1 for count in trained.values())
    assert set(trained) <= trainable_nodes(records)
    for row in result.processed.to_pylist():
        assert not any(t and not a for t, a in zip(row["train_mask"], row["action_mask"], strict=True))
        assert all(w == 0.0 for w, t in zip(row["loss_weight"], row["train_mask"], strict=True) if not t)
    per_execution = Counter(result.processed.column("execution_id").to_pylist())
    assert max(per_execution.values(), default=0) <= j_max
    rows = {row["trajectory_id"]: row for row in result.trajectories}
    assert len(rows) == len(records)
    selected_ids = set(result.processed.column("trajectory_id").to_pylist())
    assert {tid for tid, row in rows.items() if row["selected"]} == selected_ids
    assert all(
        row["drop_reason"] in {"duplicate", "no_new_tokens", "not_selected"}
        for row in rows.values()
        if not row["selected"]
    )
    # A path left out for j_max would still have added tokens: its execution selected j_max.
    for tid, row in rows.items():
        if row["drop_reason"] == "not_selected":
            assert per_execution[row["execution_id"]] == j_max, tid


def brute_common_prefix(records):
    syms = [symbols_of(row) for row in records]
    n = len(syms)
    out = np.zeros((n, n), dtype=np.int64)
    for i in range(n):
        for j in range(n):
            k = 0
            while k < min(len(syms[i]), len(syms[j])) and syms[i][k] == syms[j][k]:
                k += 1
            out[i, j] = k
    return out


def flat_paths(records):
    tokens = np.concatenate(
        [np.array(r["tokens"], dtype=np.int32) for r in records] + [np.zeros(0, np.int32)]
    )
    mask = np.concatenate([np.array(r["action_mask"], dtype=bool) for r in records] + [np.zeros(0, bool)])
    versions = np.concatenate(
        [np.array(r["versions"], dtype=np.int32) for r in records] + [np.zeros(0, np.int32)]
    )
    lengths = np.array([len(r["tokens"]) for r in records], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return path_symbols(tokens, mask, versions), starts, lengths


def assert_both_reconstructions_are_the_brute_force(records: list[dict]) -> None:
    """The prefix trees rebuilt from the tokens and from the parent ids both give the common
    prefixes a brute-force comparison of the records finds."""
    symbols, starts, lengths = flat_paths(records)
    from_tokens = tree_from_tokens(symbols, starts, lengths)
    from_parents, errors = tree_from_parents(
        [r["trajectory_id"] for r in records],
        [r["parent_id"] for r in records],
        [r["branch_at"] for r in records],
        symbols,
        starts,
        lengths,
    )
    assert errors == []
    expected = brute_common_prefix(records)
    np.testing.assert_array_equal(from_tokens.common_prefix(), expected)
    np.testing.assert_array_equal(from_parents.common_prefix(), expected)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_paths=st.integers(1, 10))
def test_reconstruction_from_tokens_equals_reconstruction_from_parent_ids(seed, n_paths):
    records = random_execution(np.random.default_rng(seed), "e", n_paths)
    assert_both_reconstructions_are_the_brute_force(records)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_paths=st.integers(2, 10))
def test_reconstruction_with_token_ids_past_30_bits_matches_the_brute_force(seed, n_paths):
    # ids of 2**30 and more take 64-bit symbols: 12-byte records, three 32-bit words each
    records = random_execution(np.random.default_rng(seed), "e", n_paths)
    for row in records:
        row["tokens"] = [t + 2**30 for t in row["tokens"]]
    assert flat_paths(records)[0].dtype["symbol"] == np.int64
    assert_both_reconstructions_are_the_brute_force(records)


class _LowestDraw:
    """A random generator whose every draw is 0.0 (``random.random`` can return it)."""

    def random(self) -> float:
        return 0.0


@pytest.mark.timeout(60)
def test_a_draw_of_zero_never_selects_a_path_that_adds_nothing():
    # "a-retry" repeats "a": in sorted order the retry comes first and has gain 0; picking it
    # would leave the remaining gain unchanged, and the sampling would pick it forever
    records = [
        record("a", "e", [1, 2, 3], [False, True, True]),
        record("a-retry", "e", [1, 2, 3], [False, True, True]),
        record("b", "e", [1, 5], [False, True]),
    ]
    symbols, starts, lengths = flat_paths(records)
    order, lcp = sorted_paths(symbols, starts, lengths)
    mask = np.concatenate([np.array(r["action_mask"]) for r in records])
    action_cumsum = np.concatenate([[0], np.cumsum(mask)])
    selection = select_paths(order, lcp, lengths, starts, action_cumsum, None, _LowestDraw())
    assert selection.selected.tolist() == [True, False, True]
    assert selection.reason == [None, "duplicate", None]


def test_identical_paths_collapse_and_prefixes_are_duplicates():
    shared = [1, 2, 3, 4]
    mask = [False, True, True, True]
    records = [
        record("a", "e", shared + [5, 6], mask + [True, True]),
        record("a-retry", "e", shared + [5, 6], mask + [True, True], parent="a", branch_at=6),
        record("a-prefix", "e", shared, mask, parent="a", branch_at=4),
        record("b", "e", shared + [7], mask + [True], parent="a", branch_at=4),
    ]
    result = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s")
    reasons = {row["trajectory_id"]: row["drop_reason"] for row in result.trajectories}
    assert reasons == {"a": None, "a-retry": "duplicate", "a-prefix": "duplicate", "b": None}
    train = {row["trajectory_id"]: row["train_mask"] for row in result.processed.to_pylist()}
    assert sum(train["a"][:4]) + sum(train["b"][:4]) == 3  # the shared prefix is trained once
    assert train["a"][4:] == [True, True] and train["b"][4:] == [True]
    assert result.counters.dropped == {"duplicate": 2}
    assert result.counters.train_tokens_out == 6


def test_the_same_token_ids_with_another_action_mask_are_different_paths():
    # token 7 is generated by the policy in one path and fed back as an observation in the other
    records = [
        record("act", "e", [5, 6, 7, 8], [False, True, True, True]),
        record("obs", "e", [5, 6, 7, 8], [False, True, False, True]),
    ]
    symbols, starts, lengths = flat_paths(records)
    _, lcp = sorted_paths(symbols, starts, lengths)
    assert lcp.tolist() == [0, 2]
    result = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s")
    reasons = {row["trajectory_id"]: row["drop_reason"] for row in result.trajectories}
    assert reasons == {"act": None, "obs": None}
    assert result.processed.num_rows == 2


def test_a_declared_prefix_only_compares_token_ids_not_their_action_mask():
    # the child shares the parent's token ids before branch_at=3, but token 7 is an
    # observation in the child: the link holds (the measured common prefix is 2)
    records = [
        record("p", "e", [5, 6, 7, 8], [False, True, True, True]),
        record("c", "e", [5, 6, 7, 8], [False, True, False, True], parent="p", branch_at=3),
    ]
    symbols, starts, lengths = flat_paths(records)
    tree, errors = tree_from_parents(["p", "c"], [None, "p"], [None, 3], symbols, starts, lengths)
    assert errors == []
    assert tree.parent.tolist() == [-1, 0] and tree.shared.tolist() == [0, 2]


def test_a_path_leading_into_a_parent_cycle_is_not_on_it():
    # c -> a -> b -> a: a and b form the cycle, c only points into it
    records = [
        record("c", "e", [1, 2, 3], [False, True, True]),
        record("a", "e", [1, 2, 4], [False, True, True]),
        record("b", "e", [1, 2, 5], [False, True, True]),
    ]
    symbols, starts, lengths = flat_paths(records)
    tree, errors = tree_from_parents(
        ["c", "a", "b"], ["a", "b", "a"], [None, None, None], symbols, starts, lengths
    )
    assert [(e.path, e.reason) for e in errors] == [(1, "cycle"), (2, "cycle")]
    assert tree.parent.tolist() == [1, -1, -1]
    assert tree.shared.tolist() == [2, 0, 0]


def test_a_path_whose_remaining_difference_is_an_observation_adds_no_tokens():
    # A and B share prompt and both actions and differ only in the final observation:
    # whichever is picked first trains both actions, the other has nothing left to train
    mask = [False, True, True, False]
    records = [
        record("A", "e", [9, 1, 2, 3], mask),
        record("B", "e", [9, 1, 2, 4], mask, parent="A", branch_at=3),
    ]
    for seed in range(4):
        result = process_shard(to_table(records), ProcessorConfig(j_max=None, seed=seed), shard_id="s")
        reasons = sorted(row["drop_reason"] or "selected" for row in result.trajectories)
        assert reasons == ["no_new_tokens", "selected"]
        assert result.processed.num_rows == 1
        assert all(any(row) for row in result.processed.column("train_mask").to_pylist())
        assert result.counters.train_tokens_out == 2


def test_a_path_whose_remaining_difference_is_an_action_still_trains_it():
    # A and B differ only in their last token, an action in both: after either is picked
    # the other still adds exactly that token
    mask = [False, True, True]
    records = [record("A", "e", [9, 1, 2], mask), record("B", "e", [9, 1, 3], mask, parent="A", branch_at=2)]
    for seed in range(4):
        result = process_shard(to_table(records), ProcessorConfig(j_max=None, seed=seed), shard_id="s")
        assert [row["drop_reason"] for row in result.trajectories] == [None, None]
        train = {row["trajectory_id"]: row["train_mask"] for row in result.processed.to_pylist()}
        assert sorted(map(tuple, train.values())) == [(False, False, True), (False, True, True)]
        assert result.counters.train_tokens_out == 3


def test_the_same_action_tokens_sampled_by_another_version_are_another_sample():
    # two sessions of one execution draw the same first actions from the same prompt, the
    # second under a later weight version: these are two samples of two behaviour policies,
    # each trained with its own log-probs (merged, the trainer's staleness filter could drop
    # the only copy trained while the fresh one sits masked out in the other row)
    mask = [False, False, True, True, True]
    first = record("old", "e", [9, 8, 1, 2, 3], mask)
    second = record("new", "e", [9, 8, 1, 2, 4], mask)
    second["logprobs"] = [0.0, 0.0, -0.25, -0.75, -1.5]
    second["versions"] = [-1, -1, 7, 7, 7]
    for seed in range(4):
        result = process_shard(
            to_table([first, second]), ProcessorConfig(j_max=None, seed=seed), shard_id="s"
        )
        rows = {row["trajectory_id"]: row for row in result.processed.to_pylist()}
        assert set(rows) == {"old", "new"}
        for row in rows.values():
            assert row["train_mask"] == mask
        assert result.counters.train_tokens_out == 6

    # drawn by one version they are one node, whatever the log-probs' last bits (batching);
    # the records of observation tokens are not samples: they do not split a shared prompt
    second = record("new", "e", [9, 8, 1, 2, 4], mask)
    second["logprobs"] = [-3.0, 0.0, -0.25, -0.75, -1.5]
    second["versions"][1] = 5
    result = process_shard(to_table([first, second]), ProcessorConfig(j_max=None), shard_id="s")
    assert result.counters.train_tokens_out == 4


def test_sampling_is_proportional_to_the_tokens_a_leaf_would_add():
    prompt = [9] * 5
    records = [
        record("small", "e", prompt + [1], [False] * 5 + [True]),
        record("large", "e", prompt + [2] * 9, [False] * 5 + [True] * 9, parent="small", branch_at=5),
    ]
    table = to_table(records)
    picks = Counter()
    for seed in range(400):
        result = process_shard(table, ProcessorConfig(j_max=1, seed=seed), shard_id="s")
        (tid,) = result.processed.column("trajectory_id").to_pylist()
        picks[tid] += 1
    # Binomial(400, 0.9): mean 360, standard deviation 6.
    assert 330 < picks["large"] < 390


def test_selection_does_not_depend_on_the_other_executions_of_the_shard():
    records = random_shard(7, 3, 8)
    config = ProcessorConfig(j_max=2, seed=11)
    whole = process_shard(to_table(records), config, shard_id="s")
    alone = process_shard(to_table([r for r in records if r["execution_id"] == "e0"]), config, shard_id="s")
    chosen = [
        t
        for t, e in zip(
            *whole.processed.select(["trajectory_id", "execution_id"]).to_pydict().values(), strict=True
        )
        if e == "e0"
    ]
    # e0 leaves paths out, so which two it keeps is the sampler's choice
    assert len(chosen) == 2 and "not_selected" in {row["drop_reason"] for row in alone.trajectories}
    assert sorted(chosen) == sorted(alone.processed.column("trajectory_id").to_pylist())


def per_token_loss(model, rows):
    """``(B, T)`` next-token loss −log p(token_t | tokens_<t) of right-padded rows (0 at t=0)."""
    length = max(len(r["tokens"]) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r["tokens"])] = torch.tensor(r["tokens"])
        attention[b, : len(r["tokens"])] = 1
    logits = model(input_ids=ids, attention_mask=attention).logits
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(len(rows), 1, dtype=logp.dtype), -logp], dim=1)


def padded(rows, key, dtype):
    length = max(len(r["tokens"]) for r in rows)
    out = torch.zeros(len(rows), length, dtype=dtype)
    for b, r in enumerate(rows):
        out[b, : len(r[key])] = torch.tensor(r[key], dtype=dtype)
    return out


def gradient(model, loss):
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def tiny_policy():
    config = TinyModelConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, vocab_size=260)
    model, tokenizer = build_tiny_model(config)
    return model.double().eval(), len(tokenizer)


@pytest.mark.parametrize("weighting", ["token", "execution"])
def test_gradient_of_deduplicated_batch_equals_original_batch_counting_each_token_once(
    weighting, tiny_policy
):
    model, vocab = tiny_policy
    rng = np.random.default_rng(3)
    records = []
    for e in range(3):
        records += random_execution(rng, f"e{e}", 6, vocab=40, fresh_from=40, max_len=20)
    for r in records:
        r["action_mask"][0] = False  # the first token has no prediction
        r["tokens"] = [t % vocab for t in r["tokens"]]
    result = process_shard(to_table(records), ProcessorConfig(j_max=None, weighting=weighting), shard_id="s")

    # Reference: every original row, each action token weighted 1 / (rows containing it).
    multiplicity = Counter()
    for r in records:
        for node in {
            (r["execution_id"], tuple(symbols_of(r)[: p + 1])) for p, a in enumerate(r["action_mask"]) if a
        }:
            multiplicity[node] += 1
    distinct = defaultdict(int)
    for eid, _ in multiplicity:
        distinct[eid] += 1
    total = sum(distinct.values())
    weights = []
    for r in records:
        row = []
        for p, a in enumerate(r["action_mask"]):
            node = (r["execution_id"], tuple(symbols_of(r)[: p + 1]))
            scale = 1.0 if weighting == "token" else 1.0 / distinct[r["execution_id"]]
            scale = float(np.float32(scale))  # loss_weight is float32
            row.append(scale / multiplicity[node] if a else 0.0)
        weights.append(row)
    reference_rows = [dict(r, w=w) for r, w in zip(records, weights, strict=True)]
    reference = (per_token_loss(model, reference_rows) * padded(reference_rows, "w", torch.float64)).sum()
    grad_reference = gradient(model, reference)

    processed = result.processed.to_pylist()
    dedup = (per_token_loss(model, processed) * padded(processed, "loss_weight", torch.float64)).sum()
    grad_dedup = gradient(model, dedup)
    # The tiny Llama normalises and rotates in float32, and the two batches have different
    # shapes (so different kernel summation orders): agreement is to float32 precision.
    torch.testing.assert_close(dedup, reference, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grad_dedup, grad_reference, rtol=1e-4, atol=1e-6)
    assert float(grad_reference.abs().max()) > 1e-3
    assert result.counters.train_tokens_out == total < sum(sum(r["action_mask"]) for r in records)


def test_every_trained_token_of_the_batched_rows_scores_as_in_its_own_trajectory_alone(tiny_policy):
    """Processed rows, cut into samples and right-padded micro-batches as the trainer does,
    give each trained token the log-prob a full forward pass over one original trajectory
    holding it gives (the slow reference), and train each distinct action token once: a
    prefix shared by branches, and a retry sampled again by another version, included."""
    model, vocab = tiny_policy
    rng = np.random.default_rng(11)
    records = []
    for e in range(3):
        execution = random_execution(rng, f"e{e}", 6, vocab=40, fresh_from=40, max_len=20)
        again = dict(
            execution[int(rng.integers(len(execution)))], trajectory_id=f"e{e}-again", parent_id=None
        )
        again["versions"] = [4 if m else -1 for m in again["action_mask"]]
        records += [*execution, again]
    for r in records:
        r["action_mask"][0] = False  # the first token has no prediction
        r["tokens"] = [t % vocab for t in r["tokens"]]

    def nodes(row):
        """``(position, node)`` of each action token: its execution and whole prefix."""
        key = list(zip(row["tokens"], row["action_mask"], row["versions"], strict=True))
        key = [(t, a, v if a else -1) for t, a, v in key]
        return [
            (p, (row["execution_id"], tuple(key[: p + 1]))) for p, a in enumerate(row["action_mask"]) if a
        ]

    reference: dict = {}
    for r in records:
        ids = torch.tensor([r["tokens"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])
        for p, node in nodes(r):
            reference.setdefault(node, float(logp[p - 1, 0]))

    result = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s")
    samples, rejected = samples_from_table(result.processed, "s", vocab)
    assert rejected == []
    rows = {r["trajectory_id"]: r for r in records}
    trained = Counter()
    parts = micro_batches(samples, micro_token_budget=40)
    for part in parts:
        batch = pad_batch(part, pad_id=0)
        with torch.no_grad():
            logprobs = token_logprobs(model, batch.input_ids, batch.attention_mask, where=batch.train_mask)
        for b, sample in enumerate(part):
            for p, node in nodes(rows[sample.trajectory_id]):
                if p < sample.num_tokens and sample.train_mask[p]:
                    trained[node] += 1
                    assert float(logprobs[b, p]) == pytest.approx(reference[node], abs=1e-5)
    assert set(trained) == set(reference)
    assert set(trained.values()) == {1}
    assert any(node[1][-1][2] == 4 for node in trained)  # the retry by another version trains
    assert len({max(s.num_tokens for s in part) for part in parts}) > 1  # padded to several lengths


def test_execution_weights_sum_to_one_per_execution_whatever_else_its_shard_holds():
    records = random_shard(5, 4, 6)
    result = process_shard(to_table(records), ProcessorConfig(j_max=3), shard_id="s")
    sums, counts = defaultdict(float), defaultdict(int)
    for row in result.processed.to_pylist():
        sums[row["execution_id"]] += sum(row["loss_weight"])
        counts[row["execution_id"]] += sum(row["train_mask"])
    trained = [e for e in counts if counts[e]]
    assert len(trained) == 4
    for e in trained:
        assert sums[e] == pytest.approx(1.0, rel=1e-5)

    # the trainer batches rows of several shards: an execution must weigh the same in any
    def weights(rows):
        processed = process_shard(to_table(rows), ProcessorConfig(j_max=None), shard_id="s").processed
        return {row["trajectory_id"]: row["loss_weight"] for row in processed.to_pylist()}

    alone = {}
    for e in trained:
        alone |= weights([r for r in records if r["execution_id"] == e])
    assert alone == weights(records)
    token = process_shard(to_table(records), ProcessorConfig(j_max=3, weighting="token"), shard_id="s")
    for row in token.processed.to_pylist():
        assert row["loss_weight"] == [1.0 if t else 0.0 for t in row["train_mask"]]


def test_malformed_links_are_reported_and_the_rest_of_the_shard_is_processed():
    good = random_execution(np.random.default_rng(1), "good", 6)
    base = [0, 1, 2, 3, 4, 5]
    mask = [False, False, True, True, True, True]
    bad = [
        record("root", "bad", base, mask),
        record("orphan", "bad", base[:3] + [7], mask[:3] + [True], parent="nowhere", branch_at=3),
        record("past", "bad", base[:3] + [8], mask[:3] + [True], parent="root", branch_at=9),
        record("negative", "bad", base[:3] + [8], mask[:3] + [True], parent="root", branch_at=-1),
        record("mismatch", "bad", [0, 1, 9, 3, 6], mask[:5], parent="root", branch_at=4),
        record("cycle-a", "bad", base[:2] + [6], mask[:3], parent="cycle-b", branch_at=2),
        record("cycle-b", "bad", base[:2] + [6, 1], mask[:4], parent="cycle-a", branch_at=2),
        record("fine", "bad", base[:4] + [9], mask[:5], parent="root", branch_at=4),
    ]
    broken_lengths = record("short-mask", "bad", base, mask)
    broken_lengths["action_mask"] = mask[:4]
    dup = record("fine", "other", [1, 2], [False, True])
    records = good + bad + [broken_lengths, dup]
    result = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s")

    reasons = {}
    for row in result.trajectories:
        reasons.setdefault(row["trajectory_id"], []).append(row["drop_reason"])
    assert reasons["orphan"] == [None]  # its parent is not in the shard: kept, as a root
    assert reasons["past"] == ["branch_past_end"]
    assert reasons["negative"] == ["branch_past_end"]
    assert reasons["mismatch"] == ["prefix_mismatch"]
    assert reasons["cycle-a"] == ["cycle"] and reasons["cycle-b"] == ["cycle"]
    assert reasons["short-mask"] == ["invalid_record"]
    assert reasons["fine"] == [None, "duplicate_id"]
    assert reasons["root"] == [None]
    counters = result.counters
    assert "missing_parent" not in counters.dropped
    for reason, count in {
        "branch_past_end": 2,
        "prefix_mismatch": 1,
        "cycle": 2,
    }.items():
        assert counters.dropped[reason] == count
    assert counters.dropped["invalid_record"] == 1 and counters.dropped["duplicate_id"] == 1
    joined = "\n".join(counters.errors)
    for tid in ("orphan", "nowhere", "past", "mismatch", "cycle-a", "short-mask"):
        assert tid in joined
    # The well-formed rows, in both executions, are processed as usual.
    kept = [r for r in records if r["execution_id"] == "good"] + [bad[0], bad[1], bad[-1]]
    assert Counter(trained_nodes(result.processed)) == Counter(trainable_nodes(kept))
    assert len(result.trajectories) == len(records) == counters.trajectories_in


@pytest.mark.parametrize("columns", [[name] for name in TOKEN_COLUMNS] + [list(TOKEN_COLUMNS)], ids=str)
@pytest.mark.parametrize("hole", ["null list", "null entry"])
def test_a_row_with_a_null_per_token_list_or_entry_is_an_invalid_record(columns, hole):
    """Such a row (in a table that did not come through the shard reader's validation) is
    reported and dropped, like one whose lists differ in length, and the rest of the shard
    is processed: it must neither crash the shard nor train with a null read as 0 or NaN."""
    good = record("good", "e", [0, 1, 2, 3], [False, True, True, True])
    broken = record("broken", "e", [0, 1, 2, 4], [False, True, True, True])
    for name in columns:
        broken[name] = None if hole == "null list" else [*broken[name][:2], None, *broken[name][3:]]
    result = process_shard(to_table([good, broken]), ProcessorConfig(j_max=None), shard_id="s")

    assert result.processed.column("trajectory_id").to_pylist() == ["good"]
    rows = {row["trajectory_id"]: row for row in result.trajectories}
    assert rows["broken"]["drop_reason"] == "invalid_record" and rows["good"]["selected"]
    assert result.counters.dropped == {"invalid_record": 1}
    assert any("'broken'" in error and "null" in error for error in result.counters.errors)
    validate(result.processed)


def test_an_empty_trajectory_in_an_execution_is_kept_and_the_shard_processed():
    """A session that failed before its first call records no tokens (an ``infra_error``),
    with or without a parent link; the others of its execution are processed as usual."""
    base = [0, 1, 2, 3, 4, 5]
    mask = [False, False, True, True, True, True]
    records = [
        record("root", "linked", base, mask),
        record("failed-child", "linked", [], [], parent="root", branch_at=0, status="infra_error"),
        record("alone", "unlinked", [], [], status="infra_error"),
        record("other", "unlinked", base[:4], mask[:4]),
    ]
    result = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s")
    assert len(result.trajectories) == 4
    kept = [r for r in records if r["tokens"]]
    assert Counter(trained_nodes(result.processed)) == Counter(trainable_nodes(kept))


def test_partial_progress_combines_with_reward():
    config = ProcessorConfig(success_threshold=1.0, progress_weight=0.5)
    assert combine_reward(1.0, 0.2, config) == 1.0
    assert combine_reward(0.1, 0.8, config) == pytest.approx(0.4)
    assert combine_reward(0.6, 0.8, config) == pytest.approx(0.6)
    assert combine_reward(None, 0.5, config) == pytest.approx(0.25)
    assert combine_reward(None, None, config) == 0.0
    assert combine_reward(0.3, 0.9, ProcessorConfig(progress_weight=0.0)) == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("reward", "progress", "weight", "expected"),
    [
        (-3.0, 0.0, 0.5, -3.0),
        (-1.0, 0.8, 0.0, -1.0),  # partial-progress scoring off
        (-1.0, 0.5, 0.5, -1.0),  # a penalty stays, whatever the progress
        (-1e-6, 1.0, 0.5, -1e-6),
        (-0.2, None, 0.5, -0.2),
        (0.0, 0.5, 0.5, 0.25),  # a failure without penalty is lifted
        (0.0, 0.5, 0.0, 0.0),
    ],
)
def test_partial_progress_never_lifts_a_negative_reward(reward, progress, weight, expected):
    config = ProcessorConfig(success_threshold=1.0, progress_weight=weight)
    assert combine_reward(reward, progress, config) == pytest.approx(expected)


def test_a_branch_whose_parent_went_into_an_earlier_shard_is_trained_as_a_root():
    root = record("root", "e", [1, 2, 3, 4], [False, True, True, True], reward=0.0)
    child = record("child", "e", [1, 2, 5, 6], [False, True, True, True], parent="root", branch_at=2)
    first = process_shard(to_table([root]), ProcessorConfig(j_max=None), shard_id="s1")
    second = process_shard(to_table([child]), ProcessorConfig(j_max=None), shard_id="s2")
    assert second.trajectories[0]["drop_reason"] is None and second.trajectories[0]["reward"] == 1.0
    assert second.processed.column("train_mask").to_pylist() == [[False, True, True, True]]
    assert second.counters.dropped == {} and "kept as a root" in second.counters.errors[0]
    together = process_shard(to_table([root, child]), ProcessorConfig(j_max=None), shard_id="s3")
    # split, the shared action token 2 is trained once in each shard; together, once
    split_tokens = sum(sum(m) for r in (first, second) for m in r.processed.column("train_mask").to_pylist())
    together_tokens = sum(sum(m) for m in together.processed.column("train_mask").to_pylist())
    assert (split_tokens, together_tokens) == (6, 5)


def test_a_reward_exactly_at_the_success_threshold_is_a_success():
    # "successful when its reward is at least success_threshold": kept as is, not raised
    # to progress_weight * progress = 0.5
    assert combine_reward(0.3, 1.0, ProcessorConfig(success_threshold=0.3)) == pytest.approx(0.3)
    assert combine_reward(0.29, 1.0, ProcessorConfig(success_threshold=0.3)) == pytest.approx(0.5)


@pytest.mark.parametrize("threshold", [0.7, 0.9, 0.1])
def test_a_reward_at_the_success_threshold_is_a_success_once_stored_as_float32(threshold):
    """A shard holds rewards as float32: 0.7 reads back as 0.69999999, under the threshold,
    so a row at it was taken for a failure, rescored, and raised to its progress (1.0)."""
    calls = []
    rows = [record("a", "e", [1, 2, 3], [False, True, True], reward=threshold, progress=None)]
    config = ProcessorConfig(success_threshold=threshold, progress_weight=1.0)
    result = process_shard(to_table(rows), config, shard_id="s", rescore=lambda t: calls.append(t) or 1.0)
    assert result.processed.column("reward").to_pylist() == [pytest.approx(threshold)]
    assert calls == []


def two_path_execution(eid, *, reward, progress=None, status="ok"):
    return [
        record(
            f"{eid}-a", eid, [1, 2, 3], [False, True, True], reward=reward, progress=progress, status=status
        ),
        record(f"{eid}-b", eid, [1, 2, 4], [False, True, True], parent=f"{eid}-a", branch_at=2, reward=1.0),
    ]


def test_rescore_is_called_once_per_execution_and_retried_within_the_budget():
    calls = []

    def rescore(rows: pa.Table) -> float:
        calls.append(sorted(rows.column("trajectory_id").to_pylist()))
        if len(calls) < 3:
            raise RuntimeError("sandbox gone")
        return 0.6

    records = two_path_execution("e", reward=0.0) + two_path_execution("f", reward=0.0, progress=0.2)
    result = process_shard(
        to_table(records), ProcessorConfig(j_max=None, rescore_attempts=3), shard_id="s", rescore=rescore
    )
    assert calls == [["e-a", "e-b"]] * 3
    rows = {r["trajectory_id"]: r for r in result.trajectories}
    # the table keeps the env's reward; the processed rows carry the one trained with
    assert rows["e-a"]["reward"] == 0.0 and rows["e-a"]["progress"] == pytest.approx(0.6)
    assert rows["f-a"]["reward"] == 0.0 and rows["e-b"]["reward"] == 1.0
    processed = {r["trajectory_id"]: r for r in result.processed.to_pylist()}
    assert processed["e-a"]["reward"] == pytest.approx(0.3)
    assert processed["f-a"]["reward"] == pytest.approx(0.1)
    assert result.counters.rescore_calls == 3 and result.counters.rescore_failures == 2


@pytest.mark.parametrize("outcome", [RuntimeError("eval crashed"), 1.5, float("nan"), "0.5", True, None])
def test_rows_are_dropped_when_rescoring_runs_out(outcome):
    def rescore(rows):
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    records = two_path_execution("e", reward=0.0) + two_path_execution("g", reward=1.0)
    result = process_shard(
        to_table(records), ProcessorConfig(j_max=None, rescore_attempts=2), shard_id="s", rescore=rescore
    )
    reasons = {r["trajectory_id"]: r["drop_reason"] for r in result.trajectories}
    assert reasons == {"e-a": "rescore_failed", "e-b": None, "g-a": None, "g-b": None}
    assert result.counters.dropped == {"rescore_failed": 1}
    assert result.counters.rescore_calls == 2
    assert any("'e'" in line and "rescore failed" in line for line in result.counters.errors)


def test_a_negative_reward_is_not_rescored_nor_dropped_when_rescoring_fails():
    """Progress never changes a negative reward (combine_reward keeps it), so a row with one
    needs no re-scoring: a failing rescore must not drop it as ``rescore_failed``."""
    calls = []

    def rescore(rows):
        calls.append(rows.num_rows)
        raise RuntimeError("eval crashed")

    records = [record("p", "e", [1, 2, 3], [False, True, True], reward=-1.0)]
    result = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s", rescore=rescore)
    assert calls == []
    assert [r["drop_reason"] for r in result.trajectories] == [None]
    assert result.processed.column("reward").to_pylist() == [-1.0]
    assert result.counters.rescore_calls == 0 and result.counters.dropped == {}


def test_a_missing_reward_at_a_threshold_of_zero_is_a_success_not_rescored_nor_dropped():
    """A missing reward counts as 0, a success when ``success_threshold`` is 0 or below
    (combine_reward keeps it): a failing rescore must not drop the row as ``rescore_failed``."""
    calls = []

    def rescore(rows):
        calls.append(rows.num_rows)
        raise RuntimeError("eval crashed")

    records = [record("p", "e", [1, 2, 3], [False, True, True], reward=None)]
    config = ProcessorConfig(j_max=None, success_threshold=0.0)
    result = process_shard(to_table(records), config, shard_id="s", rescore=rescore)
    assert calls == []
    assert [r["drop_reason"] for r in result.trajectories] == [None]
    assert result.processed.column("reward").to_pylist() == [0.0]
    assert result.counters.rescore_calls == 0 and result.counters.dropped == {}


def test_without_rescore_missing_progress_counts_as_zero():
    records = two_path_execution("e", reward=0.2)
    result = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s")
    rows = {r["trajectory_id"]: r for r in result.trajectories}
    assert rows["e-a"]["reward"] == pytest.approx(0.2) and rows["e-a"]["selected"]


@pytest.mark.parametrize("status", ["infra_error", "env_error"])
def test_failures_outside_the_policy_never_get_a_reward_nor_reach_the_loss(status):
    records = two_path_execution("e", reward=0.0, status=status) + two_path_execution("f", reward=0.0)

    def rescore(rows):
        assert status not in rows.column("status").to_pylist()
        return 0.5

    result = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s", rescore=rescore)
    rows = {r["trajectory_id"]: r for r in result.trajectories}
    assert rows["e-a"]["drop_reason"] == status and rows["e-a"]["reward"] is None
    assert "e-a" not in result.processed.column("trajectory_id").to_pylist()
    assert rows["e-b"]["selected"]
    # the prefix e-a shared with e-b is trained in e-b, since e-a never reaches the trainer
    e_b = result.processed.filter(pc.equal(result.processed.column("trajectory_id"), "e-b"))
    assert e_b.column("train_mask").to_pylist() == [[False, True, True]]
    assert rows["f-a"]["reward"] == 0.0
    f_a = result.processed.filter(pc.equal(result.processed.column("trajectory_id"), "f-a"))
    assert f_a.column("reward").to_pylist() == [pytest.approx(0.25)]


@pytest.mark.parametrize("status", ["infra_error", "env_error"])
def test_a_failure_outside_the_policy_with_a_broken_link_gets_no_reward_either(status):
    records = [
        record("root", "e", [1, 2, 3], [False, True, True]),
        record(
            "orphan",
            "e",
            [1, 2, 4],
            [False, True, True],
            parent="nowhere",
            branch_at=2,
            reward=0.7,
            status=status,
        ),
    ]
    result = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s")
    rows = {r["trajectory_id"]: r for r in result.trajectories}
    # its missing parent is reported; its status drops it, and it keeps no reward
    assert any("'orphan'" in line for line in result.counters.errors)
    assert rows["orphan"]["drop_reason"] == status
    assert rows["orphan"]["reward"] is None
    assert rows["root"]["reward"] == 1.0 and rows["root"]["selected"]
    assert result.counters.dropped == {status: 1}


@pytest.mark.parametrize("status", ["infra_error", "env_error"])
def test_a_failure_outside_the_policy_dropped_as_a_duplicate_or_invalid_record_gets_no_reward(status):
    records = [
        record("root", "e", [1, 2, 3], [False, True, True]),
        record("root", "e", [1, 2, 4], [False, True, True], reward=0.7, status=status),
        record("bad", "f", [1, 2, 3], [False, True, True], reward=0.7, status=status),
    ]
    records[2]["logprobs"] = records[2]["logprobs"][:2]
    result = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s")
    assert [(r["trajectory_id"], r["drop_reason"], r["reward"]) for r in result.trajectories] == [
        ("root", None, 1.0),
        ("root", "duplicate_id", None),
        ("bad", "invalid_record", None),
    ]


def test_trajectory_rows_and_counters():
    records = two_path_execution("e", reward=1.0) + two_path_execution("f", reward=1.0)
    records[1]["versions"] = [-1, 2, 5]
    when = datetime(2026, 1, 2, tzinfo=UTC)
    result = process_shard(
        to_table(records),
        ProcessorConfig(j_max=1, seed=0),
        shard_id="shard-7",
        decode=lambda ids: " ".join(map(str, ids)),
        processed_at=when,
    )
    rows = {r["trajectory_id"]: r for r in result.trajectories}
    assert all(set(r) == TRAJECTORY_COLUMNS for r in result.trajectories)
    row = rows["e-b"]
    assert row["text"] == "1 2 4" and row["shard_id"] == "shard-7" and row["processed_at"] == when
    assert (row["num_tokens"], row["num_action_tokens"], row["num_turns"]) == (3, 2, 2)
    assert (row["min_version"], row["max_version"]) == (2, 5)
    assert sum(r["num_train_tokens"] for r in result.trajectories) == result.counters.train_tokens_out
    c = result.counters
    assert (c.trajectories_in, c.trajectories_out, c.executions_in, c.executions_out) == (4, 2, 2, 2)
    assert (c.tokens_in, c.action_tokens_in, c.tokens_out, c.train_tokens_out) == (12, 8, 6, 4)
    assert c.dropped == {"not_selected": 2}
    assert result.processed.schema == PROCESSED_SCHEMA


def test_a_row_that_does_not_decode_keeps_its_place_with_no_text(caplog):
    records = two_path_execution("e", reward=1.0)

    def decode(ids):
        if 4 in ids:
            raise OverflowError("id out of the tokenizer's range")
        return " ".join(map(str, ids))

    result = process_shard(to_table(records), ProcessorConfig(seed=0), shard_id="s", decode=decode)
    texts = {r["trajectory_id"]: r["text"] for r in result.trajectories}
    assert texts == {"e-a": "1 2 3", "e-b": None}
    assert result.processed.num_rows == 2
    assert "e-b does not decode" in caplog.text


def test_the_text_of_each_row_decodes_its_own_tokens_across_chunks_and_broken_rows():
    """Slow reference: each input row's text is the decode of that row's token list (None
    for a null list too), whatever the table's chunks."""
    records = random_shard(5, 4, 6)
    for i in (1, 4):
        records[i]["tokens"] = None
    records[6]["tokens"] = [*records[6]["tokens"][:1], None, *records[6]["tokens"][2:]]
    table = to_table(records)
    table = pa.concat_tables([table.slice(0, 3), table.slice(3, 4), table.slice(7)])
    assert table.column("tokens").num_chunks == 3

    def decode(ids):
        return repr(ids)

    result = process_shard(table, ProcessorConfig(seed=0), shard_id="s", decode=decode)
    assert [row["trajectory_id"] for row in result.trajectories] == [r["trajectory_id"] for r in records]
    assert [row["text"] for row in result.trajectories] == [repr(r["tokens"]) for r in records]


def test_decoding_holds_one_rows_tokens_as_python_ints_at_a_time():
    """A shard of 1,000 rows of 32k tokens as Python lists at once is ~1 GB: while one row
    is decoded, no other row's tokens may be alive as a Python list."""
    # ids no other test uses: a list of another test's still alive would count as a row's
    base = 7_315_000
    records = [
        record(f"t{i}", f"e{i}", range(base + 100 * i, base + 100 * i + 50 + i), [False] + [True] * (49 + i))
        for i in range(6)
    ]
    table = to_table(records)
    wanted = {tuple(r["tokens"]) for r in records}
    del records
    others_alive = []

    def decode(ids):
        others_alive.append(
            sum(
                1
                for obj in gc.get_objects()
                if type(obj) is list
                and obj is not ids
                and 50 <= len(obj) < 56
                and all(type(item) is int for item in obj)  # another test's list may hold what hashes not
                and tuple(obj) in wanted
            )
        )
        return "text"

    result = process_shard(table, ProcessorConfig(seed=0), shard_id="s", decode=decode)
    assert [row["text"] for row in result.trajectories] == ["text"] * 6
    assert others_alive == [0] * 6


def test_trajectory_rows_fit_the_delta_table_schema():
    tables = pytest.importorskip("storage.tables")
    result = process_shard(to_table(random_shard(3, 2, 5)), shard_id="s")
    table = to_table(result.trajectories, tables.TABLE_SCHEMAS["trajectories"])
    assert set(table.column_names) == TRAJECTORY_COLUMNS


def test_empty_shard():
    result = process_shard(TRAJECTORY_SCHEMA.empty_table(), shard_id="s")
    assert result.processed.num_rows == 0 and result.trajectories == []
    assert result.counters.trajectories_in == 0 and result.counters.dropped == {}


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="j_max"):
        ProcessorConfig(j_max=0)
    with pytest.raises(ValueError, match="weighting"):
        ProcessorConfig(weighting="sequence")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_executions=st.integers(1, 4),
    max_paths=st.integers(1, 9),
    j_max=st.one_of(st.none(), st.integers(1, 4)),
)
def test_each_processed_row_carries_its_own_trajectorys_id_and_tokens(seed, n_executions, max_paths, j_max):
    """What joins a trained row to the ``trajectories`` table: a branch's processed row is the
    branch's own path under its own id, its parent's row the parent's (whichever of them
    trains the prefix they share), the ids of the processed rows are those of the selected
    ``trajectories`` rows, once each, and each such row counts the tokens its processed row
    trains. A repeated id and an excluded status never reach a processed row."""
    rng = np.random.default_rng(seed)
    records = random_shard(seed, n_executions, max_paths)
    copy = dict(records[int(rng.integers(len(records)))])  # the id again, other tokens
    copy |= {"execution_id": "other", "parent_id": None, "branch_at": None}
    copy |= {"tokens": [7, 8, 9], "action_mask": [False, True, True], "logprobs": [0.0, -0.5, -0.5]}
    copy |= {"turn": [0, 1, 1], "versions": [-1, 3, 3]}
    broken = record("broken", "other", [7, 8, 6], [False, True, True], status="env_error")
    records += [copy, broken]
    result = process_shard(to_table(records), ProcessorConfig(j_max=j_max, seed=seed), shard_id="s0")

    first = {}
    for row in records:
        first.setdefault(row["trajectory_id"], row)
    processed = result.processed.to_pylist()
    ids = [row["trajectory_id"] for row in processed]
    selected = [row for row in result.trajectories if row["selected"]]
    assert sorted(ids) == sorted(row["trajectory_id"] for row in selected) and len(set(ids)) == len(ids)
    assert copy["tokens"] not in [row["tokens"] for row in processed] and "broken" not in ids
    train_tokens = {row["trajectory_id"]: row["num_train_tokens"] for row in selected}
    for row in processed:
        raw = first[row["trajectory_id"]]
        for column in ("execution_id", "parent_id", *TOKEN_COLUMNS):
            assert row[column] == pytest.approx(raw[column]), (row["trajectory_id"], column)
        assert sum(row["train_mask"]) == train_tokens[row["trajectory_id"]]


def test_an_invalid_record_is_counted_on_its_own_lists():
    """A row dropped as ``invalid_record`` still reports its size in the ``trajectories``
    table, counted on the lists it has: its action tokens (True entries, not the mask's
    length) and its turns (none without a turn list)."""
    good = record("good", "e", [0, 1, 2, 3], [False, True, True, True])
    short = record("short", "e", [0, 1, 2, 5, 6], [False, True, False, True, True])
    short["logprobs"] = short["logprobs"][:3]
    no_turns = record("no-turns", "e", [0, 1, 7], [False, False, True])
    no_turns["turn"] = None
    result = process_shard(to_table([good, short, no_turns]), ProcessorConfig(j_max=None), shard_id="s")

    rows = {row["trajectory_id"]: row for row in result.trajectories}
    assert [rows[t]["drop_reason"] for t in ("good", "short", "no-turns")] == [
        None,
        "invalid_record",
        "invalid_record",
    ]

    def size(row):
        return row["num_tokens"], row["num_action_tokens"], row["num_turns"], row["num_train_tokens"]

    assert size(rows["good"]) == (4, 3, 2, 3)
    assert size(rows["short"]) == (5, 3, 3, 0)
    assert size(rows["no-turns"]) == (3, 1, 0, 0)
    assert (result.counters.tokens_in, result.counters.action_tokens_in) == (12, 7)


def test_executions_of_the_same_shape_draw_their_leaves_independently():
    """Each execution's generator is derived from the seed and its id: two executions with
    the same paths must not always keep the same leaf."""

    def execution(eid):
        prompt = [9, 9]
        rows = [record(f"{eid}-0", eid, [*prompt, 0], [False, False, True])]
        rows += [
            record(f"{eid}-{k}", eid, [*prompt, k], [False, False, True], parent=f"{eid}-0", branch_at=2)
            for k in range(1, 4)
        ]
        return rows

    table = to_table(execution("a") + execution("b"))
    same = []
    for seed in range(40):
        processed = process_shard(table, ProcessorConfig(j_max=1, seed=seed), shard_id="s").processed
        kept = sorted(processed.column("trajectory_id").to_pylist())
        assert len(kept) == 2
        same.append(kept[0][2:] == kept[1][2:])
    # independent draws of one of four leaves agree a quarter of the time
    assert sum(same) < 40


@pytest.mark.parametrize("status", ["infra_error", "env_error"])
def test_a_failure_outside_the_policy_with_a_link_its_tokens_deny_is_dropped_for_the_link(status):
    """Like a duplicate id or an invalid record, a broken link is the drop reason of a row
    whatever its status (the writer's defect is what the table reports), and it gets no reward."""
    records = [
        record("root", "e", [1, 2, 3], [False, True, True]),
        record("past", "e", [1, 2, 4], [False, True, True], parent="root", branch_at=9, status=status),
    ]
    result = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s")
    rows = {r["trajectory_id"]: r for r in result.trajectories}
    assert (rows["past"]["drop_reason"], rows["past"]["reward"]) == ("branch_past_end", None)
    assert result.counters.dropped == {"branch_past_end": 1}


def test_with_partial_progress_off_nothing_is_rescored_nor_dropped_when_rescoring_fails():
    """``progress_weight=0`` turns partial progress off: progress cannot change a reward, so
    a failing rescore must neither be called nor drop the rows without progress."""
    calls = []

    def rescore(rows):
        calls.append(rows.num_rows)
        raise RuntimeError("eval crashed")

    records = two_path_execution("e", reward=0.0)
    config = ProcessorConfig(j_max=None, progress_weight=0.0)
    result = process_shard(to_table(records), config, shard_id="s", rescore=rescore)
    assert calls == []
    assert [r["drop_reason"] for r in result.trajectories] == [None, None]
    assert sorted(result.processed.column("reward").to_pylist()) == [0.0, 1.0]
    assert result.counters.rescore_calls == 0 and result.counters.dropped == {}


def near_miss_execution(rng, eid, n_paths):
    """A random execution whose branches often diverge from their parent only in the role
    or the version of one token (the token id stays), or are an exact copy or a strict
    prefix of it: the cases where sharing hinges on a token's whole record, not its id.
    Version 0 (the initial weights) is among the versions: an action of version 0 and an
    observation differ in their role alone. Position 0 is never an action token (a rollout
    starts with its prompt)."""
    length = rng.randint(0, 12)
    mask = [rng.random() < 0.6 for _ in range(length)]
    paths = [
        ([rng.randrange(4) for _ in range(length)], mask, [rng.choice([0, 3]) if m else -1 for m in mask])
    ]
    for _ in range(1, n_paths):
        tokens, mask, versions = paths[rng.randrange(len(paths))]
        at = rng.randint(0, len(tokens))
        kind = rng.random()
        if kind < 0.15:  # an exact copy
            at = len(tokens)
        new = (list(tokens[:at]), list(mask[:at]), list(versions[:at]))
        if kind >= 0.3:  # not a strict prefix: the branch goes on past ``at``
            if at < len(tokens) and rng.random() < 0.5:
                # the parent's token id again, with its role flipped or by another version
                action = not mask[at] if rng.random() < 0.5 else mask[at]
                version = (7 if versions[at] != 7 else 0) if action else -1
                for column, value in zip(new, (tokens[at], action, version), strict=True):
                    column.append(value)
            for _ in range(rng.randint(0, 6)):
                action = rng.random() < 0.6
                for column, value in zip(
                    new, (rng.randrange(4), action, rng.choice([0, 3]) if action else -1), strict=True
                ):
                    column.append(value)
        paths.append(new)
    records = []
    for k, (tokens, mask, versions) in enumerate(paths):
        mask, versions = [False, *mask[1:]][: len(mask)], [-1, *versions[1:]][: len(versions)]
        records.append(record(f"{eid}-{k}", eid, tokens, mask, reward=rng.random()))
        records[-1]["versions"] = versions
    return records


def token_records(row):
    """A row's tokens as (id, role, version on actions) records: what makes two tokens one."""
    return [
        (t, a, v if a else None)
        for t, a, v in zip(row["tokens"], row["action_mask"], row["versions"], strict=True)
    ]


def action_nodes(row):
    """The distinct trainable tokens of a row, as (execution, whole prefix of records)."""
    key = token_records(row)
    return {(row["execution_id"], tuple(key[: p + 1])) for p, a in enumerate(row["action_mask"]) if a}


@pytest.mark.parametrize("seed", range(150))
def test_role_and_version_divergences_share_nothing_and_drop_reasons_hold(seed):
    """Against a brute force over whole-prefix records, on executions full of branches that
    keep the parent's token id but flip its role or resample it under another version, exact
    copies and strict prefixes: every trained token is trained once and is a real action
    node; with no cap every node is trained; a ``duplicate`` is a prefix of another path of
    its execution, a ``no_new_tokens`` path has every node trained, a ``not_selected`` one
    has a node left and its execution used its ``j_max``; each selected row trains a token
    and each execution's weights sum to 1."""
    rng = random.Random(seed)
    records = []
    for e in range(rng.randint(1, 3)):
        records += near_miss_execution(rng, f"e{e}", rng.randint(1, 8))
    rng.shuffle(records)
    j_max = rng.choice([None, 1, 2, 3])
    result = process_shard(to_table(records), ProcessorConfig(j_max=j_max, seed=seed), shard_id="s")
    validate(result.processed)

    processed = result.processed.to_pylist()
    trained = Counter()
    for row in processed:
        key = token_records(row)
        for p, t in enumerate(row["train_mask"]):
            if t:
                trained[(row["execution_id"], tuple(key[: p + 1]))] += 1
        assert any(row["train_mask"])
    every_node = set().union(set(), *(action_nodes(r) for r in records))
    assert set(trained.values()) <= {1}
    assert set(trained) <= every_node
    if j_max is None:
        assert set(trained) == every_node

    by_id = {r["trajectory_id"]: r for r in records}
    kept = Counter(row["execution_id"] for row in processed)
    for row in result.trajectories:
        mine = by_id[row["trajectory_id"]]
        if row["drop_reason"] == "duplicate":
            assert any(
                other is not mine
                and other["execution_id"] == mine["execution_id"]
                and token_records(other)[: len(mine["tokens"])] == token_records(mine)
                for other in records
            )
        elif row["drop_reason"] == "no_new_tokens":
            assert action_nodes(mine) <= set(trained)
        elif row["drop_reason"] == "not_selected":
            assert not action_nodes(mine) <= set(trained)
            assert kept[mine["execution_id"]] == j_max
        else:
            assert row["drop_reason"] is None
    sums = defaultdict(float)
    for row in processed:
        sums[row["execution_id"]] += sum(row["loss_weight"])
    assert all(s == pytest.approx(1.0, rel=1e-5) for s in sums.values())


@pytest.mark.parametrize(
    "column, value",
    [
        ("logprobs", float("nan")),
        ("logprobs", float("-inf")),
        ("reward", float("nan")),
        ("reward", float("inf")),
    ],
)
@pytest.mark.parametrize("seed", range(4))
def test_a_row_the_trainer_would_refuse_never_owns_a_shared_prefix(column, value, seed):
    """A non-finite action log-prob or reward (in a table that did not come through the
    shard reader's validation) makes the trainer refuse the row; were it kept, dedup could
    hand it the prefix it shares with a sound sibling, which would then train it nowhere,
    and its tokens would take a share of its execution's weight. It is an ``invalid_record``."""
    broken = record("broken", "e", [0, 1, 2, 3, 4], [False, True, True, True, True])
    sound = record("sound", "e", [0, 1, 2, 5, 6], [False, True, True, True, True])
    if column == "logprobs":
        broken["logprobs"][4] = value
    else:
        broken["reward"] = value
    records = [broken, sound] if seed % 2 else [sound, broken]
    result = process_shard(to_table(records), ProcessorConfig(j_max=None, seed=seed), shard_id="s")

    rows = {row["trajectory_id"]: row for row in result.trajectories}
    assert rows["broken"]["drop_reason"] == "invalid_record" and rows["sound"]["selected"]
    assert any("'broken'" in error and column in error for error in result.counters.errors)
    samples, rejected = samples_from_table(result.processed, "s", vocab_size=16)
    assert rejected == [] and [s.trajectory_id for s in samples] == ["sound"]
    assert samples[0].train_mask.tolist() == [False, True, True, True, True]
    assert float(samples[0].loss_weight.sum()) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", range(4))
def test_a_row_whose_first_token_is_an_action_is_an_invalid_record(seed):
    """Nothing precedes position 0 to score a token there from, and the trainer refuses a row
    with an action token there (:func:`rl.batching.samples_from_table`): the processor drops
    it too, rather than select it, train it, or give it a share of its execution's weight."""
    first = record("first", "e", [7, 1, 2], [True, True, True])
    sound = record("sound", "e", [0, 1, 2], [False, True, True])
    records = [first, sound] if seed % 2 else [sound, first]
    result = process_shard(to_table(records), ProcessorConfig(j_max=None, seed=seed), shard_id="s")

    rows = {row["trajectory_id"]: row for row in result.trajectories}
    assert rows["first"]["drop_reason"] == "invalid_record" and rows["sound"]["selected"]
    assert any("'first'" in error and "position 0" in error for error in result.counters.errors)
    samples, rejected = samples_from_table(result.processed, "s", vocab_size=16)
    assert rejected == [] and [s.trajectory_id for s in samples] == ["sound"]
    assert float(samples[0].loss_weight.sum()) == pytest.approx(1.0)


@pytest.mark.parametrize("progress", [1.5, -0.5, float("nan")])
def test_progress_outside_zero_one_is_an_invalid_record(progress):
    """Partial progress is in [0, 1]: a failed attempt's reward is at most
    ``progress_weight`` (:func:`combine_reward`); a row claiming more progress is malformed,
    not a success."""
    bad = record("bad", "e", [0, 1, 2], [False, True, True], reward=0.0, progress=progress)
    good = record("good", "e", [0, 1, 3], [False, True, True], reward=0.0, progress=0.5)
    result = process_shard(to_table([bad, good]), ProcessorConfig(j_max=None), shard_id="s")

    rows = {row["trajectory_id"]: row for row in result.trajectories}
    assert rows["bad"]["drop_reason"] == "invalid_record" and rows["good"]["selected"]
    assert any("'bad'" in error and "progress" in error for error in result.counters.errors)
    assert result.processed.column("reward").to_pylist() == [0.25]
