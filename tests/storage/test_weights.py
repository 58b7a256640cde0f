"""The weight-version store on a local folder and on a real S3-compatible server."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import posixpath
import re
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from deltalake import write_deltalake
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from flows.sql import connect
from storage import weights as weights_module
from storage.config import RunStore
from storage.tables import TABLE_CONFIGURATION, TABLE_SCHEMAS, Tables
from storage.weights import (
    CLAIM_FILE,
    IN_FLIGHT_S,
    MANIFEST_FILE,
    STAGING_STALE_S,
    CorruptVersion,
    VersionTaken,
    WeightStore,
    sha256_file,
    tokenizer_fingerprint,
    versions_ahead,
)
from tests.conftest import readme_query
from tests.rl.moe import tiny_glm4_moe


@pytest.fixture
def weights(store, tmp_path) -> WeightStore:
    return WeightStore(store, cache_dir=tmp_path / "cache")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {c: i + 4 for i, c in enumerate("abcdefgh")}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_llama(seed: int, tie: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=12,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config).eval()


def readme_totals(store: RunStore) -> tuple:
    """The run's stale and rejected totals by the README's query, run as ``treadle sql`` runs it."""
    return connect(store).execute(readme_query("SUM(rejected_rows)")).fetchone()


def publish_model(weights: WeightStore, model, tokenizer_dir, **kwargs) -> int:
    return weights.publish(model.state_dict(), model.config.to_dict(), tokenizer_dir, **kwargs)


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def corrupt(weights: WeightStore, version: int, name: str) -> None:
    path = posixpath.join(weights.version_path(version), name)
    payload = bytearray(weights.fs.cat_file(path))
    payload[len(payload) // 2] ^= 0xFF
    weights.fs.pipe_file(path, bytes(payload))


def test_publish_load_is_hugging_face_loadable(weights, tokenizer_dir):
    model = tiny_llama(seed=0, tie=True)
    version = publish_model(weights, model, tokenizer_dir, step=7, metadata={"consumed_shards": ["a", "b"]})
    assert version == 0 and weights.latest() == 0 and weights.list() == [0]

    local = weights.load()
    loaded = AutoModelForCausalLM.from_pretrained(local).eval()
    ids = torch.tensor([[1, 4, 5, 6, 7]])
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(model, ids), rtol=0, atol=0)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    with safe_open(os.path.join(local, "model.safetensors"), "pt") as stored:
        names = set(stored.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    tokenizer = AutoTokenizer.from_pretrained(local)
    assert tokenizer.convert_tokens_to_ids(["a", "h"]) == [4, 11]

    manifest = weights.manifest(0)
    assert manifest["step"] == 7 and manifest["parent"] is None
    assert manifest["metadata"] == {"consumed_shards": ["a", "b"]}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(manifest["files"])
    for name, digest in manifest["files"].items():
        assert sha256_file(posixpath.join(local, name)) == digest


def test_versions_advance_with_parent_extra_files_and_untied_weights(weights, tokenizer_dir):
    first = publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    untied = tiny_llama(seed=1, tie=False)
    optimizer_state = b"\x00optimizer" * 100
    second = publish_model(
        weights, untied, None, step=3, parent=first, extra_files={"optimizer/state.pt": optimizer_state}
    )
    assert (first, second) == (0, 1)
    assert weights.latest() == 1 and weights.list() == [0, 1]
    assert weights.manifest(1)["parent"] == 0

    local = weights.load(1)
    assert Path(local, "optimizer/state.pt").read_bytes() == optimizer_state
    loaded = AutoModelForCausalLM.from_pretrained(local).eval()
    ids = torch.tensor([[2, 3, 9]])
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(untied, ids), rtol=0, atol=0)
    assert json.loads(Path(local, "config.json").read_text())["tie_word_embeddings"] is False


def test_the_index_names_only_the_policy_and_named_chat_templates_are_kept(weights, tokenizer_dir, tmp_path):
    """A loader that takes every ``*.safetensors`` of a folder unless an index says which
    (vLLM) must not take the trainer's value model for policy weights."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = {
        "default": "{% for m in messages %}{{ m.content }}</s>{% endfor %}",
        "tool_use": "{% for m in messages %}TOOL {{ m.content }}</s>{% endfor %}",
    }
    templated = tmp_path / "templated"
    tokenizer.save_pretrained(templated)
    assert list(templated.glob("*/*.jinja")), "precondition: a named template is saved in a subfolder"
    value_model = {"head.weight": torch.ones(1, 16)}
    buffer = tmp_path / "value.safetensors"
    save_file(value_model, buffer)
    model = tiny_llama(seed=0, tie=True)
    version = publish_model(
        weights, model, str(templated), extra_files={"value_model.safetensors": buffer.read_bytes()}
    )

    local = weights.load(version)
    index = json.loads(Path(local, "model.safetensors.index.json").read_text())
    with safe_open(os.path.join(local, "model.safetensors"), "pt") as stored:
        policy = set(stored.keys())
    assert index["weight_map"] == dict.fromkeys(sorted(policy), "model.safetensors")
    assert index["metadata"]["total_size"] == os.path.getsize(os.path.join(local, "model.safetensors")) - (
        8 + int.from_bytes(Path(local, "model.safetensors").read_bytes()[:8], "little")
    )
    loaded = AutoModelForCausalLM.from_pretrained(local).eval()
    ids = torch.tensor([[1, 4, 5]])
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(model, ids), rtol=0, atol=0)
    messages = [{"role": "user", "content": "ab"}]
    assert AutoTokenizer.from_pretrained(local).apply_chat_template(
        messages, chat_template="tool_use", tokenize=False
    ) == tokenizer.apply_chat_template(messages, chat_template="tool_use", tokenize=False)


def test_corrupt_file_is_refused_by_name_and_previous_version_still_loads(weights, tokenizer_dir, tmp_path):
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    publish_model(weights, tiny_llama(seed=1), tokenizer_dir)
    corrupt(weights, 1, "model.safetensors")

    with pytest.raises(CorruptVersion, match=r"weight version 1: file 'model.safetensors' is corrupt"):
        weights.load()
    previous = weights.load(0)
    AutoModelForCausalLM.from_pretrained(previous)

    weights.fs.rm_file(posixpath.join(weights.version_path(0), "tokenizer.json"))
    uncached = WeightStore(weights.store, cache_dir=tmp_path / "uncached")
    with pytest.raises(CorruptVersion, match=r"'tokenizer.json' listed in the manifest is missing"):
        uncached.load(0)


def test_unreadable_manifest_and_missing_versions_give_clear_errors(weights, tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="no weight version published"):
        weights.load()
    assert weights.latest() is None and weights.list() == []
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    with pytest.raises(KeyError, match="weight version 5 does not exist"):
        weights.manifest(5)
    weights.fs.pipe_file(posixpath.join(weights.version_path(0), "manifest.json"), b"{not json")
    with pytest.raises(CorruptVersion, match="manifest.json is not valid JSON"):
        weights.load(0)


@pytest.mark.parametrize(
    "name", ["../../escaped.txt", "/tmp/escaped.txt", "a/./b", "a//b", "..\\escaped.txt"]
)
def test_a_manifest_naming_files_outside_its_version_is_corrupt(store, tokenizer_dir, tmp_path, name):
    weights = WeightStore(store, cache_dir=tmp_path / "cache" / "deep" / "down")
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    payload = b"written outside the version"
    if not name.startswith("/"):  # where a download would fetch it from
        store.fs.pipe_file(posixpath.normpath(posixpath.join(weights.version_path(0), name)), payload)
    placed = set(tmp_path.rglob("*escaped*"))
    manifest = weights.manifest(0)
    manifest["files"][name] = hashlib.sha256(payload).hexdigest()
    weights.fs.pipe_file(
        posixpath.join(weights.version_path(0), "manifest.json"), json.dumps(manifest).encode()
    )

    with pytest.raises(
        CorruptVersion, match=rf"weight version 0: manifest.json lists {re.escape(repr(name))}"
    ):
        weights.load(0)
    with pytest.raises(CorruptVersion):
        weights.manifest(0)
    assert set(tmp_path.rglob("*escaped*")) == placed


def _damaged(files: dict, how: str) -> dict:
    files = dict(files)
    if how == "null digest":
        files["tokenizer.json"] = None
    elif how == "number digest":
        files["config.json"] = 12345
    elif how == "short digest":
        files["model.safetensors"] = files["model.safetensors"][:12]
    else:  # "files emptied": nothing would be verified
        files = {}
    return files


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("null digest", "gives 'tokenizer.json' the digest None, not a sha256 in hex"),
        ("number digest", "gives 'config.json' the digest 12345, not a sha256 in hex"),
        ("short digest", "gives 'model.safetensors' the digest"),
        ("files emptied", r"does not list \['model.safetensors', 'config.json'\]"),
    ],
)
def test_a_manifest_whose_digests_cannot_verify_the_version_is_corrupt(
    store, tokenizer_dir, tmp_path, how, message
):
    weights = WeightStore(store, cache_dir=tmp_path / "cache")
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    manifest = weights.manifest(0)
    manifest["files"] = _damaged(manifest["files"], how)
    weights.fs.pipe_file(
        posixpath.join(weights.version_path(0), "manifest.json"), json.dumps(manifest).encode()
    )
    with pytest.raises(CorruptVersion, match=rf"weight version 0: manifest.json {message}"):
        weights.load(0)


def test_retention_keeps_a_version_whose_manifest_is_unreadable_and_prunes_the_rest(
    weights, tokenizer_dir, caplog
):
    model = tiny_llama(seed=0)
    for _ in range(5):
        publish_model(weights, model, tokenizer_dir)
    weights.fs.pipe_file(posixpath.join(weights.version_path(1), "manifest.json"), b'{"files": {"x')

    assert weights.retain(keep_last=1) == [0, 2, 3]
    assert weights.list() == [1, 4] and weights.latest() == 4
    assert "keeps weight version 1, whose tag cannot be read" in caplog.text
    assert weights.retain(keep_last=1) == []


def test_retention_keeps_the_newest_version_that_verifies_when_latest_does_not(
    weights, tokenizer_dir, caplog
):
    """With LATEST's version corrupt, keep_last=1 kept that version alone and deleted the one
    the trainer and the workers load instead, leaving nothing loadable."""
    for seed in range(4):
        publish_model(weights, tiny_llama(seed=seed), tokenizer_dir)
    corrupt(weights, 3, "model.safetensors")
    corrupt(weights, 2, "config.json")

    assert weights.retain(keep_last=1) == [0]
    assert weights.list() == [1, 2, 3] and weights.load_newest()[0] == 1
    assert "retention keeps the versions down to one that verifies: weight version 3" in caplog.text
    assert weights.retain(keep_last=1, verified=2) == [1]  # vouched for: not read back
    assert weights.list() == [2, 3]


def test_retention_with_a_garbled_latest_keeps_the_newest_version_that_verifies(
    weights, tokenizer_dir, caplog
):
    """A garbled LATEST names no version, as for a load or a publish: retention raised
    ``CorruptVersion`` instead, so the maintain flow's retain-weights step failed on every run
    until someone rewrote LATEST by hand."""
    for seed in range(4):
        publish_model(weights, tiny_llama(seed=seed), tokenizer_dir)
    corrupt(weights, 3, "model.safetensors")
    weights.fs.pipe_file(posixpath.join(weights.root, "LATEST"), b"\x00garbage")

    assert weights.retain(keep_last=1) == [0, 1]
    assert weights.list() == [2, 3] and weights.load_newest()[0] == 2
    assert "holds '\\x00garbage', not a version number" in caplog.text


def test_listing_the_versions_makes_no_request_per_version(store, tokenizer_dir, monkeypatch):
    """A worker lists the versions at each load (twice: the newest that verifies, the cached
    copies to tidy) and a run keeps every version unless told otherwise: one request per
    version (a HEAD of its manifest) made each load of a long run thousands of requests, and
    seconds to minutes, on S3."""
    if not store.config.is_s3:
        pytest.skip("a request per version costs only on S3")
    weights = WeightStore(store)
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    for version in range(1, 40):  # complete as far as a listing can tell, without 39 uploads
        weights.fs.pipe_file(posixpath.join(weights.version_path(version), MANIFEST_FILE), b"{}")
    weights.fs.pipe_file(posixpath.join(weights.version_path(40), CLAIM_FILE), b"being written")
    requests = []
    call_s3 = weights.fs._call_s3

    async def counted(method, *args, **kwargs):
        requests.append(method)
        return await call_s3(method, *args, **kwargs)

    monkeypatch.setattr(weights.fs, "_call_s3", counted)
    assert weights.list() == list(range(40))
    assert len(requests) <= 3, requests


def test_latest_does_not_move_back_when_two_publishes_race(store, tokenizer_dir, tmp_path):
    """Publish A (v1) reads LATEST, publish B (v2) runs whole, then A writes LATEST."""
    slow = WeightStore(store, cache_dir=tmp_path / "a")
    fast = WeightStore(store, cache_dir=tmp_path / "b")
    model = tiny_llama(seed=0)
    assert publish_model(slow, model, tokenizer_dir) == 0
    read_latest = slow.latest
    raced = []

    def latest_then_let_the_other_finish() -> int | None:
        seen = read_latest()
        if not raced and slow.list() == [0, 1]:  # A's manifest is written: A is about to write LATEST
            raced.append(publish_model(fast, model, tokenizer_dir))
        return seen

    slow.latest = latest_then_let_the_other_finish
    assert publish_model(slow, model, tokenizer_dir) == 1
    assert raced == [2]
    assert fast.latest() == 2 and fast.list() == [0, 1, 2]


def test_remote_cache_is_reverified_and_repaired(store, tmp_path, tokenizer_dir):
    if not store.config.is_s3:
        pytest.skip("the download cache exists only for a remote store")
    weights = WeightStore(store, cache_dir=tmp_path / "cache")
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    local = weights.load(0)
    assert local.startswith(str(tmp_path / "cache"))
    original = Path(local, "config.json").read_text()
    with open(posixpath.join(local, "config.json"), "a") as handle:
        handle.write(" ")
    assert weights.load(0) == local
    assert Path(local, "config.json").read_text() == original
    AutoModelForCausalLM.from_pretrained(local)

    corrupt(weights, 0, "config.json")
    assert weights.load(0) == local  # the cached copy still matches the manifest
    with pytest.raises(CorruptVersion, match="'config.json' is corrupt"):
        WeightStore(store, cache_dir=tmp_path / "uncached").load(0)
    assert not list((tmp_path / "uncached").rglob("*.json"))


def test_a_download_deletes_the_cached_copies_of_versions_the_store_no_longer_has(
    store, tmp_path, tokenizer_dir
):
    if not store.config.is_s3:
        pytest.skip("the download cache exists only for a remote store")
    weights = WeightStore(store, cache_dir=tmp_path / "cache")
    model = tiny_llama(seed=0)
    for version, part in enumerate(["all", "serving", "tokenizer"]):
        publish_model(weights, model, tokenizer_dir, tag="base" if version == 0 else None)
        weights.load(version, part)
    assert weights.retain(keep_last=1) == [1]
    publish_model(weights, model, tokenizer_dir)

    def cached():
        return sorted(
            path.relative_to(weights.cache_dir).as_posix() for path in weights.cache_dir.rglob("v0*")
        )

    weights.load(3)
    # the serving copy of 1 stays while this store has loaded no other serving copy since
    assert cached() == ["serving/v000001", "tokenizer/v000002", "v000000", "v000003"]
    weights.load(3, "serving")
    assert cached() == ["tokenizer/v000002", "v000000", "v000003"]


def serving_one_then_retaining_the_newest(store, tmp_path, tokenizer_dir) -> tuple[WeightStore, list, str]:
    """Versions 0-2 of three models; version 1 loaded to serve (its copy returned) before 2 is
    published and a retention (``keep_last=1``) deletes 0 and 1 from the store."""
    weights = WeightStore(store, cache_dir=tmp_path / "cache")
    models = [tiny_llama(seed=seed) for seed in range(3)]
    publish_model(weights, models[0], tokenizer_dir)
    publish_model(weights, models[1], tokenizer_dir)
    serving = weights.load(1, "serving")
    publish_model(weights, models[2], tokenizer_dir)
    assert weights.retain(keep_last=1) == [0, 1]
    return weights, models, serving


def test_a_version_loaded_stays_whole_when_a_retention_deletes_it_from_the_store(
    store, tmp_path, tokenizer_dir
):
    """An engine that has just loaded a version reads its files after ``load`` returned: a
    retention (``keep_last=1``) deleting that version from the store meanwhile leaves the
    engine's copy whole, on a local folder as on S3."""
    weights, models, serving = serving_one_then_retaining_the_newest(store, tmp_path, tokenizer_dir)
    loaded = AutoModelForCausalLM.from_pretrained(serving).eval()
    AutoTokenizer.from_pretrained(serving)
    ids = torch.tensor([[1, 4, 5]])
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(models[1], ids), rtol=0, atol=0)
    assert weights.load(2, "serving") != serving and not Path(serving).exists()  # forgotten at the next load


ANOTHER_ENGINE = """
import json, sys
from storage.config import RunStore, StorageConfig
from storage.weights import WeightStore
config, run_id, cache_dir, version = json.loads(sys.argv[1])
print(WeightStore(RunStore(StorageConfig(**config), run_id), cache_dir=cache_dir).load(version, "serving"))
"""


def test_a_copy_one_engine_loaded_stays_whole_while_another_sharing_its_cache_tidies(
    store, tmp_path, tokenizer_dir
):
    """Engines on one machine (processes) share the weight cache. One's load tidying away the
    copies of versions a retention deleted must leave the copy another has just loaded (and
    reads after ``load`` returned) until that one loads another version."""
    weights, models, serving = serving_one_then_retaining_the_newest(store, tmp_path, tokenizer_dir)

    config = {
        name: value.get_secret_value() if hasattr(value, "get_secret_value") else value
        for name, value in store.config
    }
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            ANOTHER_ENGINE,
            json.dumps([config, store.run_id, str(tmp_path / "cache"), 2]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        check=True,
    )
    assert other.stdout.strip() == weights.load(2, "tokenizer")  # its copy, in the same cache
    loaded = AutoModelForCausalLM.from_pretrained(serving).eval()
    ids = torch.tensor([[1, 4, 5]])
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(models[1], ids), rtol=0, atol=0)
    assert weights.load(2, "serving") != serving and not Path(serving).exists()


def test_a_store_that_loads_version_after_version_keeps_one_copy_per_part(store, tmp_path, tokenizer_dir):
    """A rollout worker loads each version the trainer publishes, for days. With every version
    kept in the store (``keep_versions`` None), each load left its copy in the cache: a
    model's size more on the worker's disk per version (downloaded from S3, or copied from a
    folder on another file system). With ``one_copy`` a store's load deletes the copy its part
    used before, unless another process sharing the cache uses it: that one deletes it at its
    own next load."""
    weights = WeightStore(store, cache_dir=tmp_path / "cache", one_copy=True)
    other = WeightStore(RunStore(store.config, store.run_id), cache_dir=tmp_path / "cache", one_copy=True)
    model = tiny_llama(seed=0)
    for _ in range(4):
        publish_model(weights, model, tokenizer_dir)

    def cached():
        return sorted(
            path.relative_to(weights.cache_dir).as_posix() for path in weights.cache_dir.rglob("v0*")
        )

    held = other.load(1, "serving")
    for version in range(4):
        path = weights.load(version, "serving")
        assert weights.load(version, "serving") == path  # loaded again: the same copy stays
    assert cached() == ["serving/v000001", "serving/v000003"] and Path(held, "config.json").is_file()
    other.load(3, "serving")
    assert cached() == ["serving/v000003"]


def test_a_store_released_leaves_no_copy_in_the_cache_that_no_other_store_holds(
    store, tmp_path, tokenizer_dir
):
    """An evaluation's store, a trainer's once its model and optimizer are read, a worker's
    once it stops: each load's copy stayed in the cache for good (``one_copy`` deletes only a
    store's previous copy, at its next load), a trainer's whole version with its optimizer
    state per restart. Released, a ``one_copy`` store deletes its copies unless another store
    holds them; a store without ``one_copy`` only lets go of them."""
    publish_model(WeightStore(store), tiny_llama(seed=0), tokenizer_dir)
    cache = tmp_path / "cache"

    evaluation = WeightStore(store, cache_dir=cache, one_copy=True)

    def cached():
        return sorted(
            path.relative_to(evaluation.cache_dir).as_posix() for path in cache.rglob("v0*") if path.is_dir()
        )

    trainer = WeightStore(RunStore(store.config, store.run_id), cache_dir=cache, one_copy=True)
    keeper = WeightStore(RunStore(store.config, store.run_id), cache_dir=cache)
    held = evaluation.load(0, "serving")
    assert Path(trainer.load(0, "all"), "model.safetensors").is_file()
    assert cached() == ["serving/v000000", "v000000"]
    assert trainer.load(0, "serving") != held  # the whole version's copy serves too
    trainer.release()
    assert cached() == ["serving/v000000"] and Path(held, "config.json").is_file()
    keeper.load(0, "serving")
    evaluation.release()
    assert cached() == ["serving/v000000"] and Path(held, "config.json").is_file()
    keeper.release()
    assert cached() == ["serving/v000000"]
    again = WeightStore(store, cache_dir=cache, one_copy=True)
    assert again.load(0, "serving") == held
    again.release()
    assert cached() == []
    assert Path(WeightStore(store, cache_dir=cache).load(0, "serving"), "config.json").is_file()


A_KILLED_WORKER = """
import json, os, signal, sys
from storage.config import RunStore, StorageConfig
from storage.weights import WeightStore
config, run_id, cache_dir = json.loads(sys.argv[1])
WeightStore(RunStore(StorageConfig(**config), run_id), cache_dir=cache_dir, one_copy=True).load(0, "serving")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_copies_a_killed_process_left_go_at_the_next_one_copy_load(store, tmp_path, tokenizer_dir):
    """A worker killed (OOM, SIGKILL) never releases its copy, and no later store ever held
    it to let it go: a model's size on the disk per kill while the store keeps every version.
    The next ``one_copy`` load of the part deletes it, and leaves a copy another store holds."""
    weights = WeightStore(store, cache_dir=tmp_path / "cache", one_copy=True)
    for seed in range(3):
        publish_model(weights, tiny_llama(seed=seed), tokenizer_dir)
    config = {
        name: value.get_secret_value() if hasattr(value, "get_secret_value") else value
        for name, value in store.config
    }
    killed = subprocess.run(
        [sys.executable, "-c", A_KILLED_WORKER, json.dumps([config, store.run_id, str(tmp_path / "cache")])],
        capture_output=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert killed.returncode == -9, killed.stderr

    def cached():
        return sorted(path.name for path in (weights.cache_dir / "serving").glob("v*"))

    assert cached() == ["v000000"]
    holder = WeightStore(RunStore(store.config, store.run_id), cache_dir=tmp_path / "cache")
    held = holder.load(1, "serving")
    weights.load(2, "serving")
    assert cached() == ["v000001", "v000002"] and Path(held, "config.json").is_file()
    holder.release()
    weights.load(2, "serving")
    assert cached() == ["v000002"]


def test_a_part_served_from_a_larger_parts_copy_tidies_without_a_warning(
    store, tmp_path, tokenizer_dir, caplog
):
    """A tokenizer loaded from a cached serving copy has no folder of its own parts yet: the
    tidy of its part's copies finds nothing to do, and says nothing."""
    weights = WeightStore(store, cache_dir=tmp_path / "cache", one_copy=True)
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    serving = weights.load(0, "serving")
    tokenizer = WeightStore(RunStore(store.config, store.run_id), cache_dir=tmp_path / "cache", one_copy=True)
    with caplog.at_level(logging.WARNING, logger="storage.weights"):
        assert tokenizer.load(0, "tokenizer") == serving
    assert caplog.records == []


def test_a_copy_deleted_between_its_fetch_and_its_marking_in_use_is_fetched_again(
    store, tmp_path, tokenizer_dir
):
    """A load verifies a cached copy (hashing it: seconds for a real model) before it marks
    it in use. A ``one_copy`` store sharing the cache (another engine, a rollout worker) that
    moves on meanwhile deletes that copy, the version still in the store: the load must not
    return a folder that is gone."""
    weights = WeightStore(store, cache_dir=tmp_path / "cache", one_copy=True)
    other = WeightStore(RunStore(store.config, store.run_id), cache_dir=tmp_path / "cache")
    models = [tiny_llama(seed=seed) for seed in range(2)]
    for model in models:
        publish_model(weights, model, tokenizer_dir)
    held = weights.load(0, "serving")
    fetch = other._fetch

    def fetch_then_the_worker_moves_on(*args):
        path = fetch(*args)
        if path == held:
            weights.load(1, "serving")  # lands before this load marks the copy in use
        return path

    other._fetch = fetch_then_the_worker_moves_on
    serving = other.load(0, "serving")
    assert Path(serving, "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(serving).eval()
    ids = torch.tensor([[1, 4, 5]])
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(models[0], ids), rtol=0, atol=0)
    weights.load(1, "serving")  # loaded again: the copy other holds stays
    assert Path(serving, "config.json").is_file()


def test_a_cached_copy_deleted_while_it_is_verified_is_fetched_again(store, tmp_path, tokenizer_dir):
    """A load re-verifies a cached copy before using it (hashing it: seconds for a real
    model). A ``one_copy`` store sharing the cache that moves on meanwhile deletes that copy:
    the verify then finds a file missing, and deleting the copy it took for corrupt raised
    ``FileNotFoundError`` (which ``load_newest`` does not pass over either)."""
    weights = WeightStore(store, cache_dir=tmp_path / "cache", one_copy=True)
    other = WeightStore(RunStore(store.config, store.run_id), cache_dir=tmp_path / "cache")
    models = [tiny_llama(seed=seed) for seed in range(2)]
    for model in models:
        publish_model(weights, model, tokenizer_dir)
    held = weights.load(0, "serving")
    verify = other._verify

    def verify_while_the_worker_moves_on(local_dir, files, version):
        if local_dir == held and Path(held).is_dir():
            weights.load(1, "serving")  # deletes the copy of version 0, which other holds not yet
        verify(local_dir, files, version)

    other._verify = verify_while_the_worker_moves_on
    serving = other.load(0, "serving")
    loaded = AutoModelForCausalLM.from_pretrained(serving).eval()
    ids = torch.tensor([[1, 4, 5]])
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(models[0], ids), rtol=0, atol=0)


def test_an_engine_loads_the_policy_and_never_the_trainers_extra_files(
    store, tmp_path, tokenizer_dir, monkeypatch
):
    """A trainer's optimizer states and value model are several times the policy's size:
    an engine's load (``serving``) and a tokenizer's never fetch or hash them."""
    weights = WeightStore(store, cache_dir=tmp_path / "cache")
    model = tiny_llama(seed=0)
    extra = {"policy_optimizer.pt": b"moments" * 1000, "value/model.safetensors": b"value" * 1000}
    publish_model(weights, model, tokenizer_dir, extra_files=extra)
    assert weights.manifest(0)["extra_files"] == sorted(extra)
    for name in extra:  # corrupt: a load that verified them would refuse the version
        corrupt(weights, 0, name)
    fetched = []
    get_file = store.fs.get_file
    monkeypatch.setattr(
        store.fs, "get_file", lambda remote, local: (fetched.append(remote), get_file(remote, local))
    )

    serving = weights.load(0, "serving")
    ids = torch.tensor([[1, 4, 5]])
    loaded = AutoModelForCausalLM.from_pretrained(serving).eval()
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(model, ids), rtol=0, atol=0)
    tokenizer = AutoTokenizer.from_pretrained(weights.load(0, "tokenizer"))
    assert tokenizer.convert_tokens_to_ids(["a", "h"]) == [4, 11]
    if store.config.is_s3:
        names = {posixpath.relpath(remote, weights.version_path(0)) for remote in fetched}
        assert names == set(weights.manifest(0)["files"]) - set(
            extra
        )  # the tokenizer's came from the serving copy
        assert not {name for name in extra if Path(serving, name).exists()}
        tokenizer_only = WeightStore(store, cache_dir=tmp_path / "tokenizer-only").load(0, "tokenizer")
        assert (
            not Path(tokenizer_only, "model.safetensors").exists()
            and not Path(tokenizer_only, "model.safetensors.index.json").exists()
            and Path(tokenizer_only, "config.json").exists()
        )
    with pytest.raises(CorruptVersion, match="'policy_optimizer.pt' is corrupt"):
        weights.load(0)  # a trainer resuming needs them whole
    with pytest.raises(ValueError, match="part must be one of"):
        weights.load(0, "srving")


def test_a_version_from_before_extra_files_were_named_serves_every_file(store, tmp_path, tokenizer_dir):
    weights = WeightStore(store, cache_dir=tmp_path / "cache")
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir, extra_files={"state.pt": b"state"})
    manifest = weights.manifest(0)
    del manifest["extra_files"]
    store.fs.pipe_file(
        posixpath.join(weights.version_path(0), "manifest.json"), json.dumps(manifest).encode()
    )
    assert Path(weights.load(0, "serving"), "state.pt").read_bytes() == b"state"
    for bad in ("state.pt", ["config.json"], ["absent.pt"], [["state.pt"]]):
        store.fs.pipe_file(
            posixpath.join(weights.version_path(0), "manifest.json"),
            json.dumps(manifest | {"extra_files": bad}).encode(),
        )
        with pytest.raises(CorruptVersion, match="gives extra_files"):
            weights.load(0, "serving")


def test_version_being_written_is_invisible(weights, tokenizer_dir, monkeypatch):
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    real_put = weights.fs.put_file
    uploaded = []

    def put_then_fail(source, target, *args, **kwargs):
        if uploaded:
            raise OSError("connection dropped (injected)")
        uploaded.append(target)
        return real_put(source, target, *args, **kwargs)

    monkeypatch.setattr(weights.fs, "put_file", put_then_fail)
    with pytest.raises(OSError, match="injected"):
        publish_model(weights, tiny_llama(seed=1), tokenizer_dir)
    monkeypatch.undo()

    assert uploaded and uploaded[0].startswith(weights.version_path(1))
    assert weights.latest() == 0 and weights.list() == [0]
    with pytest.raises(KeyError):
        weights.manifest(1)
    assert publish_model(weights, tiny_llama(seed=2), tokenizer_dir) == 2
    assert weights.retain(keep_last=5) == []  # claimed a moment ago: it may still be uploading
    assert weights.retain(keep_last=5, in_flight_s=0) == [1]
    assert weights.list() == [0, 2]
    assert not weights.fs.exists(weights.version_path(1))


def test_the_tokenizer_fingerprint_follows_the_vocabulary_not_the_serialisation(weights, tokenizer_dir):
    text = (Path(tokenizer_dir) / "tokenizer.json").read_text()
    data = json.loads(text)
    same = tokenizer_fingerprint(json.dumps(data, indent=4, sort_keys=True).encode())
    assert same == tokenizer_fingerprint(text.encode()) is not None
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    assert tokenizer_fingerprint(json.dumps(data).encode()) != same
    assert tokenizer_fingerprint(b"not json") is None
    version = publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    assert weights.manifest(version)["tokenizer_fingerprint"] == same


def test_latest_only_moves_forward(weights, tokenizer_dir):
    model = tiny_llama(seed=0)
    assert publish_model(weights, model, tokenizer_dir) == 0
    assert publish_model(weights, model, tokenizer_dir, version=3) == 3
    assert publish_model(weights, model, tokenizer_dir, version=2) == 2  # finished after 3
    assert weights.latest() == 3 and weights.list() == [0, 2, 3]


def test_retain_keeps_last_and_tagged(weights, tokenizer_dir):
    model = tiny_llama(seed=0)
    for version in range(6):
        publish_model(weights, model, tokenizer_dir, tag="best" if version == 1 else None)
    assert weights.retain(keep_last=2) == [0, 2, 3]
    assert weights.list() == [1, 4, 5]
    assert weights.latest() == 5
    AutoModelForCausalLM.from_pretrained(weights.load(1))
    assert not weights.fs.exists(weights.version_path(0))
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        weights.retain(0)


def test_retention_keeps_the_directory_latest_names_though_its_manifest_is_gone(weights, tokenizer_dir):
    """LATEST stays: a version whose manifest was lost is passed over by a load, but its
    directory is not taken for a crashed publish's leftovers, however old its claim."""
    model = tiny_llama(seed=0)
    for _ in range(3):
        publish_model(weights, model, tokenizer_dir)
    weights.fs.rm_file(posixpath.join(weights.version_path(1), "manifest.json"))
    weights.fs.pipe_file(posixpath.join(weights.root, "LATEST"), b"1\n")

    assert weights.retain(keep_last=1, in_flight_s=0) == []
    assert weights.fs.exists(weights.version_path(1)) and weights.list() == [0, 2]


def test_a_retention_that_prunes_nothing_at_or_below_latest_reads_no_checkpoint(
    weights, tokenizer_dir, caplog
):
    """Only a retention about to delete a version at or below LATEST looks for the newest one
    that verifies (reading checkpoints whole): one that keeps them all reads none."""
    model = tiny_llama(seed=0)
    for _ in range(3):
        publish_model(weights, model, tokenizer_dir)
    corrupt(weights, 2, "model.safetensors")

    assert weights.retain(keep_last=3) == []
    assert "retention keeps the versions down to one that verifies" not in caplog.text


def test_retention_deletes_an_unfinished_version_only_below_the_newest_once_its_claim_is_old(
    weights, tokenizer_dir
):
    """An incomplete directory is a crashed publish's leftovers only below the newest complete
    version (above it, it is the next version) and once its claim is older than
    ``in_flight_s`` (a publish still uploading renews it)."""
    model = tiny_llama(seed=0)
    for _ in range(2):
        publish_model(weights, model, tokenizer_dir)

    def killed() -> None:
        raise RuntimeError("killed before its manifest")

    with pytest.raises(RuntimeError, match="killed before its manifest"):
        publish_model(weights, model, tokenizer_dir, before_commit=killed)
    assert weights.retain(keep_last=1, in_flight_s=0) == [0]
    assert weights.fs.exists(weights.version_path(2))

    publish_model(weights, model, tokenizer_dir)
    assert weights.retain(keep_last=1) == [1]
    assert weights.fs.exists(weights.version_path(2))
    assert weights.retain(keep_last=1, in_flight_s=0) == [2]
    assert not weights.fs.exists(weights.version_path(2)) and weights.list() == [3]


def test_latest_temp_files_of_killed_publishes_are_swept_once_as_old_as_a_dead_claim(
    local_store, tokenizer_dir, tmp_path
):
    """A publish killed between writing LATEST's temporary file and renaming it over LATEST
    left ``LATEST.tmp-<hex>`` in the weights folder, which nothing deleted; one younger than
    ``IN_FLIGHT_S`` may be a write in progress."""
    weights = WeightStore(local_store, cache_dir=tmp_path / "cache")
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    old, young = (f"LATEST.tmp-{seed * 32}" for seed in "ab")
    for name in (old, young):
        weights.fs.pipe_file(posixpath.join(weights.root, name), b"1\n")
    long_ago = time.time() - IN_FLIGHT_S - 60
    os.utime(posixpath.join(weights.root, old), (long_ago, long_ago))

    assert weights.sweep_latest_temps() == [old]
    assert not weights.fs.exists(posixpath.join(weights.root, old))
    assert weights.fs.exists(posixpath.join(weights.root, young))
    assert weights.latest() == 0 and weights.list() == [0]


def test_claim_and_manifest_temp_files_of_killed_publishes_are_swept_from_kept_versions(
    local_store, tokenizer_dir, tmp_path
):
    """On a local folder a claim (made, or renewed while uploading) and a manifest are written
    to ``<name>.tmp-<hex>`` first: a publish killed in between left it in the version's folder,
    which a kept version keeps for ever. Swept once as old as a dead claim; a younger one may
    be a write in progress."""
    weights = WeightStore(local_store, cache_dir=tmp_path / "cache")
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    folder = weights.version_path(0)
    old = [f"CLAIM.tmp-{'a' * 32}", f"manifest.json.tmp-{'b' * 32}"]
    young = f"CLAIM.tmp-{'c' * 32}"
    for name in [*old, young]:
        weights.fs.pipe_file(posixpath.join(folder, name), b"half")
    long_ago = time.time() - IN_FLIGHT_S - 60
    for name in old:
        os.utime(posixpath.join(folder, name), (long_ago, long_ago))

    assert weights.sweep_latest_temps() == sorted(f"v000000/{name}" for name in old)
    assert sorted(map(posixpath.basename, weights.fs.ls(folder, detail=False))) == sorted(
        [*weights.manifest(0)["files"], MANIFEST_FILE, CLAIM_FILE, young]
    )
    assert weights.load(0)


def test_a_retention_killed_while_deleting_a_version_leaves_no_complete_looking_remains(
    weights, tokenizer_dir, monkeypatch
):
    """The manifest goes before the files: a retention that dies deleting them leaves a
    directory no reader takes for a version."""
    model = tiny_llama(seed=0)
    for _ in range(2):
        publish_model(weights, model, tokenizer_dir)

    def killed(path, recursive=False):
        raise OSError("killed while deleting the files")

    monkeypatch.setattr(weights.fs, "rm", killed)
    with pytest.raises(OSError, match="killed while deleting the files"):
        weights.retain(keep_last=1)
    assert weights.list() == [1]


def test_a_claim_with_no_time_zone_reads_as_unreadable_and_retention_goes_on(weights, tokenizer_dir):
    """Every claim this treadle writes holds a UTC time with its offset: one without (garbled)
    is no publish's, and retention deletes its leftovers rather than raising ``TypeError``
    (which would stop every later retention of the run, the trainer's included)."""
    model = tiny_llama(seed=0)
    for _ in range(3):
        publish_model(weights, model, tokenizer_dir)
    weights.fs.rm_file(posixpath.join(weights.version_path(1), "manifest.json"))
    weights.fs.pipe_file(posixpath.join(weights.version_path(1), "CLAIM"), b"2020-01-01T00:00:00 pid 1\n")

    assert weights.claim_age(1) == float("inf")
    assert weights.retain(keep_last=1) == [0, 1]
    assert weights.list() == [2] and not weights.fs.exists(weights.version_path(1))


def test_a_file_holding_a_version_name_is_swept_by_retention_not_raised_on(
    local_store, tokenizer_dir, tmp_path
):
    weights = WeightStore(local_store, cache_dir=tmp_path / "cache")
    model = tiny_llama(seed=0)
    for _ in range(3):
        publish_model(weights, model, tokenizer_dir)
    weights.fs.rm(weights.version_path(1), recursive=True)
    weights.fs.pipe_file(weights.version_path(1), b"left by hand, not a version folder")

    assert weights.retain(keep_last=1) == [0, 1]
    assert weights.list() == [2] and not weights.fs.exists(weights.version_path(1))


def test_a_cached_copy_missing_a_file_is_fetched_again(weights, tokenizer_dir):
    model = tiny_llama(seed=0)
    version = publish_model(weights, model, tokenizer_dir)
    os.remove(os.path.join(weights.load(version), "config.json"))

    assert os.path.isfile(os.path.join(weights.load(version), "config.json"))


def test_bad_publish_arguments(weights, tokenizer_dir, tmp_path):
    state = tiny_llama(seed=0).state_dict()
    config = tiny_llama(seed=0).config.to_dict()
    with pytest.raises(ValueError, match="'../escape' must be a relative path"):
        weights.publish(state, config, None, extra_files={"../escape": b""})
    with pytest.raises(ValueError, match="'manifest.json' is reserved"):
        weights.publish(state, config, None, extra_files={"manifest.json": b""})
    with pytest.raises(ValueError, match="metadata must be JSON-serialisable"):
        weights.publish(state, config, None, metadata={"x": object()})
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        weights.publish(state, config, str(tmp_path / "nope"))
    with pytest.raises(TypeError, match=r"state_dict\['w'\] is a str"):
        weights.publish({"w": "not a tensor"}, config, None)
    with pytest.raises(ValueError, match="version must be >= 0, got -1"):  # it wrote LATEST '-1'
        weights.publish(state, config, None, version=-1)
    assert weights.list() == [] and weights.latest() is None
    assert publish_model(weights, tiny_llama(seed=0), tokenizer_dir) == 0  # refused ones claimed no number
    with pytest.raises(ValueError, match="prefix must be one folder name"):
        WeightStore(weights.store, prefix="../elsewhere")


def test_two_stores_on_one_run_see_the_same_versions(store, tokenizer_dir, tmp_path):
    writer = WeightStore(store, cache_dir=tmp_path / "a")
    reader = WeightStore(RunStore(store.config, store.run_id), cache_dir=tmp_path / "b")
    assert reader.latest() is None
    publish_model(writer, tiny_llama(seed=0), tokenizer_dir)
    assert reader.latest() == 0
    AutoModelForCausalLM.from_pretrained(reader.load())


def test_publishers_racing_for_a_number_never_write_into_one_directory(
    store, tokenizer_dir, tmp_path, monkeypatch
):
    first, second = tiny_llama(seed=0), tiny_llama(seed=1)
    a = WeightStore(store, cache_dir=tmp_path / "a")
    b = WeightStore(RunStore(store.config, store.run_id), cache_dir=tmp_path / "b")
    assert publish_model(a, first, tokenizer_dir, version=0) == 0
    with pytest.raises(VersionTaken, match="weight version 0 of .* is claimed by another publish"):
        publish_model(b, second, tokenizer_dir, version=0)
    # b read the store before a claimed 1: its publish moves on to 2
    monkeypatch.setattr(b, "_next_version", lambda: 1)
    assert publish_model(a, first, tokenizer_dir) == 1
    assert publish_model(b, second, tokenizer_dir) == 2
    ids = torch.tensor([[1, 4, 5, 6]])
    for version, model in ((0, first), (1, first), (2, second)):
        loaded = AutoModelForCausalLM.from_pretrained(a.load(version))
        torch.testing.assert_close(logits_of(loaded, ids), logits_of(model, ids))
        assert a.fs.exists(posixpath.join(a.version_path(version), CLAIM_FILE))
    assert a.list() == [0, 1, 2] and a.latest() == 2
    with pytest.raises(ValueError, match="'CLAIM' is reserved"):
        publish_model(a, first, tokenizer_dir, extra_files={CLAIM_FILE: b""})


def test_a_retry_of_a_publish_that_completed_does_not_write_over_its_version(weights, tokenizer_dir):
    """An attempt that wrote its manifest and then failed (say, on its weights row) is retried
    under the same owner: its claim is its own but the version is complete, so the retry must
    not upload into it (a loader may be reading those files) and gets VersionTaken."""
    first = tiny_llama(seed=0)
    assert publish_model(weights, first, tokenizer_dir, version=0, owner="task-a") == 0
    published = weights.manifest(0)
    with pytest.raises(VersionTaken, match="weight version 0 of .* is claimed by another publish"):
        publish_model(weights, tiny_llama(seed=1), tokenizer_dir, version=0, owner="task-a")
    assert weights.manifest(0) == published and weights.list() == [0]
    ids = torch.tensor([[1, 4, 5, 6]])
    loaded = AutoModelForCausalLM.from_pretrained(weights.load(0))
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(first, ids))


def test_latest_never_names_a_version_another_publish_is_still_writing(weights, tokenizer_dir):
    """A publish of version 0 reads the versions back after writing LATEST while another
    publish has claimed 1 and is still uploading: LATEST stays on 0, the newest complete one,
    rather than naming a version that has no manifest yet."""
    assert weights._claim(1, "uploading") == 1
    assert publish_model(weights, tiny_llama(seed=0), tokenizer_dir, version=0) == 0
    assert weights.latest() == 0 and weights.recover_latest() == 0
    assert weights.load_newest()[0] == 0


def test_recovery_moves_a_latest_left_on_an_older_version_to_the_newest(weights, tokenizer_dir):
    """A publish wrote its manifest and died before LATEST: recovery points LATEST at the
    newest complete version, not only when LATEST is missing or garbled."""
    for seed in range(3):
        publish_model(weights, tiny_llama(seed=seed), tokenizer_dir)
    weights.fs.pipe_file(posixpath.join(weights.root, "LATEST"), b"1\n")
    assert weights.recover_latest() == 2 and weights.latest() == 2


def test_a_publish_never_takes_a_number_at_or_below_latest(weights, tokenizer_dir):
    """LATEST names version 1, whose directory is gone (deleted by hand): the next publish
    takes 2, as a number at or below LATEST would never become the latest."""
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    publish_model(weights, tiny_llama(seed=1), tokenizer_dir)
    weights.fs.rm(weights.version_path(1), recursive=True)
    assert publish_model(weights, tiny_llama(seed=2), tokenizer_dir) == 2
    assert weights.latest() == 2 and weights.list() == [0, 2]


def test_a_claim_being_renewed_is_never_read_as_a_dead_one(local_store, monkeypatch):
    """A publisher that lost the race for a version reads the winner's claim while the winner
    renews it: a claim seen empty half-way through a write would read as infinitely old."""
    monkeypatch.setattr(weights_module, "CLAIM_REFRESH_S", 0.0005)
    weights = WeightStore(local_store)
    assert weights._claim(0, "winner") == 0
    ages = []
    with weights._claim_kept_fresh(0, "winner"):
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            ages.append(weights.claim_age(0))
    assert len(ages) > 100 and max(ages) < 60


def test_an_object_created_exclusively_is_never_seen_empty(local_store):
    paths = [local_store.path("claims", f"c{i}") for i in range(300)]
    seen_empty = []

    def read() -> None:
        deadline = time.monotonic() + 60
        for path in paths:
            while not os.path.exists(path):
                if time.monotonic() > deadline:  # the writer failed: its error says why
                    return
            with open(path, "rb") as handle:
                if not handle.read():
                    seen_empty.append(path)

    reader = threading.Thread(target=read)
    reader.start()
    for path in paths:
        local_store.create_exclusive(path, b"made\n")
    reader.join()
    assert seen_empty == []
    with pytest.raises(FileExistsError):
        local_store.create_exclusive(paths[0], b"again\n")


@pytest.mark.parametrize("overtaken_at", ["manifest", "removal"])
def test_two_retentions_at_once_both_finish(store, tokenizer_dir, tmp_path, monkeypatch, overtaken_at):
    """A trainer's retention after its publish and the maintain flow's may run at once: the
    one that finds a version already deleted by the other (before it reads its manifest, or
    before it deletes it) leaves it so and goes on."""
    trainer = WeightStore(store, cache_dir=tmp_path / "a")
    maintain = WeightStore(RunStore(store.config, store.run_id), cache_dir=tmp_path / "b")
    model = tiny_llama(seed=0)
    for _ in range(6):
        publish_model(trainer, model, tokenizer_dir)
    overtaken = []

    def overtaken_before(call):
        def first_the_other(version):
            if not overtaken:
                overtaken.append(trainer.retain(keep_last=2))
            return call(version)

        return first_the_other

    if overtaken_at == "manifest":  # the other deletes between the listing and the manifests' reads
        monkeypatch.setattr(maintain, "manifest", overtaken_before(maintain.manifest))
    else:  # the other deletes once the versions to delete are chosen
        monkeypatch.setattr(maintain, "manifest", lambda version: {"tag": None})
        monkeypatch.setattr(maintain, "version_path", overtaken_before(maintain.version_path))
    maintain.retain(keep_last=2)
    assert overtaken == [[0, 1, 2, 3]]
    assert trainer.list() == [4, 5] and trainer.latest() == 5


def test_a_local_versions_files_are_on_disk_before_its_manifest_and_latest(
    local_store, tokenizer_dir, monkeypatch
):
    """Every file, and the folder entries naming them, is flushed to disk before the manifest
    makes the version complete; the manifest's and LATEST's renames are flushed too: a power
    loss must not leave LATEST on a version whose files are empty."""
    weights = WeightStore(local_store)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    version = publish_model(
        weights, tiny_llama(seed=0), tokenizer_dir, extra_files={"trainer/state.json": b"{}"}
    )
    target = weights.version_path(version)
    manifest_at = next(i for i, path in enumerate(synced) if os.path.basename(path).startswith(MANIFEST_FILE))
    before_manifest = set(synced[:manifest_at])
    files = weights.manifest(version)["files"]
    assert {posixpath.join(target, name) for name in files} <= before_manifest
    assert {target, posixpath.join(target, "trainer")} <= before_manifest
    after_manifest = synced[manifest_at:]
    assert target in after_manifest and weights.root in after_manifest  # the renames


def test_a_download_deletes_the_staging_folders_of_downloads_that_died(store, tmp_path, tokenizer_dir):
    """A process killed mid-download leaves its staging folder (a model's worth of files): the
    next download deletes one untouched for STAGING_STALE_S, and keeps one still being written."""
    if not store.config.is_s3:
        pytest.skip("the download cache exists only for a remote store")
    weights = WeightStore(store, cache_dir=tmp_path / "cache")
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    weights.load(0)
    dead = weights.cache_dir / f".all-v000000.tmp-{'a' * 32}"
    alive = weights.cache_dir / f".serving-v000000.tmp-{'b' * 32}"
    for folder in (dead, alive):
        (folder / "model.safetensors").parent.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"partial")
    long_ago = time.time() - STAGING_STALE_S - 60
    for path in (dead, dead / "model.safetensors", alive):
        os.utime(path, (long_ago, long_ago))  # alive's file was written just now
    publish_model(weights, tiny_llama(seed=1), tokenizer_dir)
    weights.load(1)
    assert not dead.exists() and alive.is_dir()


def test_a_garbled_latest_or_a_version_that_does_not_verify_is_passed_over(
    weights, tokenizer_dir, tmp_path, caplog
):
    for seed in range(3):
        publish_model(weights, tiny_llama(seed=seed), tokenizer_dir)
    corrupt(weights, 2, "model.safetensors")
    latest = posixpath.join(weights.root, "LATEST")
    weights.fs.pipe_file(latest, b"\x00garbage")  # a truncated or garbled write
    assert weights.load_newest("serving")[0] == 1
    assert "holds '\\x00garbage', not a version number" in caplog.text
    assert "weight version 2: file 'model.safetensors' is corrupt" in caplog.text
    assert weights.recover_latest() == 2 and weights.latest() == 2
    weights.fs.pipe_file(latest, b"99\n")  # names no version
    assert weights.load_newest("serving")[0] == 1
    assert "LATEST names weight version 99, which has no manifest" in caplog.text

    corrupt(weights, 1, "config.json")
    weights.fs.rm_file(posixpath.join(weights.version_path(0), "model.safetensors"))
    uncached = WeightStore(weights.store, cache_dir=tmp_path / "uncached")
    with pytest.raises(CorruptVersion, match=r"no weight version of .* verifies \(LATEST names") as error:
        uncached.load_newest("serving")
    assert "\n" not in str(error.value)


def test_the_weights_table_counts_what_each_version_dropped_and_rejected(local_store, tokenizer_dir):
    """A run begun by an older treadle, whose ``weights`` table has no ``dropped_stale`` nor
    ``rejected_rows`` column, goes on with versions whose manifests list them: their rows carry
    the counts, the base version's reads null, and the README's totals add them up."""
    weights, tables = WeightStore(local_store), Tables(local_store)
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir, tag="base")
    schema = TABLE_SCHEMAS["weights"]
    old_schema = pa.schema(
        [field for field in schema if field.name not in ("dropped_stale", "rejected_rows")]
    )
    old_row = {name: value for name, value in weights.table_row(0).items() if name in old_schema.names}
    write_deltalake(
        tables.uri("weights"),
        pa.Table.from_pylist([old_row], schema=old_schema),
        configuration=TABLE_CONFIGURATION,
    )
    assert readme_totals(local_store) == (None, None)

    for parent, (stale, rejected) in enumerate([(3, 2), (0, 5)]):
        metadata = {"consumed_shards": ["a"], "dropped_stale": stale, "rejected_rows": rejected}
        version = publish_model(
            weights, tiny_llama(seed=parent + 1), tokenizer_dir, parent=parent, metadata=metadata
        )
        assert weights.record(tables, version)
    rows = tables.read("weights", columns=["version", "dropped_stale", "rejected_rows"]).sort_by("version")
    assert rows.to_pylist() == [
        {"version": 0, "dropped_stale": None, "rejected_rows": None},
        {"version": 1, "dropped_stale": 3, "rejected_rows": 2},
        {"version": 2, "dropped_stale": 0, "rejected_rows": 5},
    ]
    assert readme_totals(local_store) == (3, 7)


@pytest.mark.parametrize("garbage", [b"\xff\xfe7", "²\n".encode()], ids=["not-utf8", "not-a-decimal"])
def test_a_latest_that_is_not_utf8_or_holds_a_unicode_digit_is_garbled_too(weights, tokenizer_dir, garbage):
    """A LATEST holding bytes that do not decode, or a digit ``int`` refuses, raised
    UnicodeDecodeError or ValueError from every reader instead of being passed over."""
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    weights.fs.pipe_file(posixpath.join(weights.root, "LATEST"), garbage)
    with pytest.raises(CorruptVersion, match="not a version number"):
        weights.latest()
    assert weights.load_newest("serving")[0] == 0
    assert weights.recover_latest() == 0 and weights.latest() == 0


def test_a_publish_that_takes_back_its_own_old_claim_renews_it_before_uploading(
    weights, tokenizer_dir, monkeypatch
):
    """A retry taking back the claim its failed attempt made two hours ago uploaded under that
    old time until the first renewal (CLAIM_REFRESH_S later): a retention meanwhile took the
    directory for a dead publish's and deleted the files already uploaded."""
    claimed = (datetime.now(UTC) - timedelta(hours=2)).isoformat()
    claim = posixpath.join(weights.version_path(0), CLAIM_FILE)
    weights.fs.pipe_file(claim, f"{claimed} pid 1 owner task-a\n".encode())
    assert publish_model(weights, tiny_llama(seed=1), tokenizer_dir) == 1
    real_put = weights.fs.put_file
    removed = []

    def put_then_retain(source, target, *args, **kwargs):
        real_put(source, target, *args, **kwargs)
        if "/v000000/" in target and not removed:
            removed.append(weights.retain(keep_last=1))

    monkeypatch.setattr(weights.fs, "put_file", put_then_retain)
    assert publish_model(weights, tiny_llama(seed=0), tokenizer_dir, version=0, owner="task-a") == 0
    assert removed == [[]]
    weights.load(0)


def test_a_load_that_a_retention_overtakes_takes_the_newer_latest(
    store, tokenizer_dir, tmp_path, monkeypatch
):
    """A worker or an evaluation downloading LATEST's version while the trainer publishes two
    more and its ``keep_versions`` deletes it (and every version below): the load is told the
    version was deleted, not that it is corrupt, and ``load_newest`` goes on to the new LATEST
    rather than failing with "no weight version verifies"."""
    trainer = WeightStore(store, cache_dir=tmp_path / "trainer")
    models = [tiny_llama(seed=seed) for seed in range(4)]
    for model in models[:2]:
        publish_model(trainer, model, tokenizer_dir)
    worker = WeightStore(RunStore(store.config, store.run_id), cache_dir=tmp_path / "worker")
    fetch_file = worker._fetch_file

    def overtaken(stored, local):
        if trainer.latest() == 1:  # the first file of version 1: the trainer moves on meanwhile
            for model in models[2:]:
                publish_model(trainer, model, tokenizer_dir)
            assert trainer.retain(keep_last=2) == [0, 1]
        fetch_file(stored, local)

    monkeypatch.setattr(worker, "_fetch_file", overtaken)
    version, path = worker.load_newest("serving")
    assert version == 3
    ids = torch.tensor([[1, 4, 5]])
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(models[3], ids), rtol=0, atol=0)

    for model in models[:2]:  # the same race under a load of one named version
        publish_model(trainer, model, tokenizer_dir)
    racing = trainer.latest()
    monkeypatch.setattr(
        worker,
        "_fetch_file",
        lambda stored, local: (
            trainer.fs.rm(trainer.version_path(racing), recursive=True),
            fetch_file(stored, local),
        ),
    )
    with pytest.raises(
        KeyError, match=f"weight version {racing} was deleted from .* while it was being loaded"
    ):
        worker.load(racing, "serving")


def test_a_latest_write_that_fails_leaves_no_temporary_file(local_store, tokenizer_dir, monkeypatch):
    """A rename of LATEST's temporary file that fails (EDQUOT, ENOSPC: the folder must grow)
    fails the publish; the temporary file is deleted, as nothing else ever would (a retention
    deletes version folders only)."""
    weights = WeightStore(local_store)
    publish_model(weights, tiny_llama(seed=0), tokenizer_dir)
    real_replace = os.replace

    def replace(source, target):
        if os.path.basename(target) == "LATEST":
            raise OSError(errno.EDQUOT, "Disk quota exceeded (injected)")
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="injected"):
        publish_model(weights, tiny_llama(seed=1), tokenizer_dir)
    monkeypatch.undo()
    assert weights.recover_latest() == 1
    assert sorted(os.listdir(weights.root)) == ["LATEST", "v000000", "v000001"]


def test_a_recent_chain_follows_parents_and_extends_a_known_one_with_one_read(weights, tokenizer_dir):
    """Version 4 was trained from 2 (3 was another line): the chain follows parents, not numbers.
    A worker read a new version's whole chain again at each one (``max_staleness + 1`` manifest
    reads, each a request on S3); given the chain it read before, one."""
    model = tiny_llama(seed=0)
    for version, parent in ((0, None), (1, 0), (2, 1), (3, 2), (4, 2), (5, 4)):
        publish_model(weights, model, tokenizer_dir, version=version, parent=parent)
    assert weights.recent_chain(4, 10) == [0, 1, 2, 4]
    assert weights.recent_chain(4, 3) == [1, 2, 4]
    assert versions_ahead([1, 2, 4], 3) == 1 and versions_ahead([1, 2, 4], 0) == 3

    read = []
    manifest = weights.manifest

    def counted(version: int) -> dict:
        read.append(version)
        return manifest(version)

    weights.manifest = counted
    assert weights.recent_chain(5, 3, known=[1, 2, 4]) == [2, 4, 5] and read == [5]
    read.clear()
    assert weights.recent_chain(5, 10, known=[0, 1, 2, 4]) == [0, 1, 2, 4, 5] and read == [5]


def test_a_bfloat16_publish_keeps_the_routers_a_bfloat16_load_keeps_in_float32(weights, tokenizer_dir):
    """GLM-4.5 and DeepSeek-V3 keep their routers in float32 whatever dtype they load in
    (``_keep_in_fp32_modules_strict``), as the trainer does (``rl.models.placed``): published
    in bfloat16 they were rounded, so an engine picked other experts than the trainer."""
    model = tiny_glm4_moe(12)
    routers = {name: t for name, t in model.state_dict().items() if ".mlp.gate." in name}
    assert routers and not all(torch.equal(t, t.bfloat16().float()) for t in routers.values())

    local = weights.load(publish_model(weights, model, tokenizer_dir, dtype=torch.bfloat16))
    published = load_file(os.path.join(local, "model.safetensors"))
    kept = {name: tensor for name, tensor in published.items() if tensor.dtype == torch.float32}
    assert kept.keys() == routers.keys()
    for name, tensor in kept.items():
        assert torch.equal(tensor, routers[name]), name
    served = AutoModelForCausalLM.from_pretrained(local, dtype=torch.bfloat16).state_dict()
    for name, tensor in routers.items():
        assert torch.equal(served[name], tensor), name


@pytest.mark.parametrize(
    "extra_files",
    [
        {"tokenizer.json": b"optimizer"},  # it replaced the tokenizer, then left out of the engines' part
        {"tokenizer.json/state": b"x"},
        {"state": b"x", "state/inner": b"y"},
        {"state/inner": b"y", "state": b"x"},
    ],
)
def test_an_extra_file_that_clashes_with_a_tokenizer_file_or_another_extra_is_refused(
    weights, tokenizer_dir, extra_files
):
    name = next(reversed(extra_files))
    with pytest.raises(ValueError, match=f"extra file name {name!r} clashes with"):
        publish_model(weights, tiny_llama(seed=0), tokenizer_dir, extra_files=extra_files)
    assert weights.list() == [] and weights.latest() is None


def test_a_cached_copy_deleted_between_a_files_check_and_its_hashing_is_fetched_again(
    store, tmp_path, tokenizer_dir, monkeypatch
):
    """A ``one_copy`` store sharing the cache deletes a copy file by file while another load
    verifies it: a file found present, then gone when opened to hash it, raised a bare
    ``FileNotFoundError`` out of the load (which ``load_newest`` does not pass over either)."""
    weights = WeightStore(store, cache_dir=tmp_path / "cache")
    other = WeightStore(RunStore(store.config, store.run_id), cache_dir=tmp_path / "cache")
    model = tiny_llama(seed=0)
    publish_model(weights, model, tokenizer_dir)
    held = Path(weights.load(0, "serving"))
    hash_file = weights_module.sha256_file

    def hash_once_the_copy_is_gone(path):
        if Path(path).parent == held:
            Path(path).unlink(missing_ok=True)
        return hash_file(path)

    monkeypatch.setattr(weights_module, "sha256_file", hash_once_the_copy_is_gone)
    serving = other.load(0, "serving")
    monkeypatch.setattr(weights_module, "sha256_file", hash_file)
    loaded = AutoModelForCausalLM.from_pretrained(serving).eval()
    ids = torch.tensor([[1, 4, 5]])
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(model, ids), rtol=0, atol=0)
