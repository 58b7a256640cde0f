"""The weight-version store: ``weights/v000042/`` directories that Hugging Face can load.

A version directory holds ``model.safetensors``, its ``model.safetensors.index.json``,
``config.json``, the tokenizer files, any extra files (optimizer state, consumed shard ids,
the trainer's value model) and ``manifest.json`` with the sha256 of every other file. The
index names the policy's tensors, so a loader that would take every ``*.safetensors`` of
the folder (vLLM does, without an index) takes only the policy's file. The manifest names
the extra files too, so an engine's load fetches and verifies the policy alone
(``load(part="serving")``, see ``PARTS``). A publish stages its files locally, then claims
its version number by creating the directory's ``CLAIM`` object exclusively (``O_EXCL``
locally, a conditional PUT on S3), so two publishers racing for one number never write into
the same directory (a retry of a publish that failed after its claim, naming the same
``owner``, takes it back).
Files are uploaded next, the manifest after them and ``weights/LATEST`` last (temp file + rename on a local
folder, a single PUT on S3), so a reader never sees a version that is still being written:
a directory without a manifest does not exist. ``LATEST`` only moves forward: a publish that
finishes after a newer one leaves it alone, and one that raced a newer one (both read the old
``LATEST``, the older wrote last) reads the versions back and puts the newest one back.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from storage.config import RunStore, fsync_path
from storage.heartbeat import Heartbeat

if TYPE_CHECKING:
    import torch

    from storage.tables import Tables

log = logging.getLogger(__name__)

PRETRAINED_LOAD_LOCK = threading.Lock()
"""Held around every ``from_pretrained`` of a weight version: transformers' loading is not
thread-safe (concurrent loads in one process, as an engine and a trainer starting in the
threads of one flow, leave parameters on the meta device)."""

MODEL_FILE = "model.safetensors"
MODEL_INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "LATEST"
CLAIM_FILE = "CLAIM"
CLAIM_REFRESH_S = 30.0
"""While a publish uploads its files, its claim's time is renewed this often, so a claim
older than a few of these belongs to a publish that died."""
IN_FLIGHT_S = 3600.0
"""A claim older than this belongs to a publish that died (see ``retain``), and so does a
temporary file of ``LATEST`` this old (a live publish renames it away at once)."""
TOKENIZER_FILE = "tokenizer.json"
Part = Literal["all", "serving", "tokenizer"]
PARTS: tuple[Part, ...] = ("all", "serving", "tokenizer")
"""What a load fetches, each part holding the next: every file; all but the extra files
(the policy as an engine loads it: weights, index, config, tokenizer); the tokenizer's files
and ``config.json``. A trainer's optimizer states and value model are extra files, several
times the policy's size, that only a trainer reads."""
RESERVED_FILES = frozenset({MODEL_FILE, MODEL_INDEX_FILE, CONFIG_FILE, MANIFEST_FILE, CLAIM_FILE})
_SHA256 = re.compile(r"[0-9a-f]{64}")
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_VERSION_MANIFEST = re.compile(rf"^v(\d{{6,}})/{re.escape(MANIFEST_FILE)}$")
_IN_USE_FILE = re.compile(r"^\.(v\d{6,})\.in-use$")
_STAGING_DIR = re.compile(r"^\.\w+-v\d{6,}\.tmp-[0-9a-f]{32}$")
_LATEST_TEMP = re.compile(rf"^{LATEST_FILE}\.tmp-[0-9a-f]{{32}}$")
_VERSION_TEMP = re.compile(rf"^({CLAIM_FILE}|{re.escape(MANIFEST_FILE)})\.tmp-[0-9a-f]{{32}}$")
STAGING_STALE_S = 3600.0
"""A download's staging folder untouched this long was left by a process that died mid-download."""
_HASH_CHUNK = 1 << 20


class CorruptVersion(RuntimeError):
    """A weight version's files do not match its manifest (or the manifest is unreadable)."""


def _claim_text(owner: str | None) -> bytes:
    """A claim's content: when it was made (or renewed), by which process and ``owner``."""
    owned = "" if owner is None else f" owner {owner}"
    return f"{datetime.now(UTC).isoformat()} pid {os.getpid()}{owned}\n".encode()


def _missing_file(version: int, name: str) -> CorruptVersion:
    return CorruptVersion(f"weight version {version}: file {name!r} listed in the manifest is missing")


def _corrupt_file(version: int, name: str, actual: str, expected: str) -> CorruptVersion:
    return CorruptVersion(
        f"weight version {version}: file {name!r} is corrupt "
        f"(sha256 {actual[:12]}… does not match the manifest's {expected[:12]}…)"
    )


class VersionTaken(FileExistsError):
    """The version number a publish asked for is claimed by another publish."""


def _let_go(in_use: dict[str, tuple[int, Path]]) -> None:
    """Close the in-use files a collected store held locked (see :meth:`WeightStore.load`)."""
    for handle, _ in in_use.values():
        os.close(handle)
    in_use.clear()


def versions_ahead(chain: list[int], version: int) -> int:
    """Versions the newest of ``chain`` (a :meth:`WeightStore.recent_chain`) is ahead of
    ``version``: the newer versions on its chain. The difference of the numbers would also
    count those the chain skips (a number a publish claimed before it was killed, a version a
    resumed trainer passed over as it did not verify). Past the part of the chain known each
    number counts; a version newer than the chain's counts as the negative difference."""
    if version > chain[-1]:
        return chain[-1] - version
    if version < chain[0]:
        return len(chain) - 1 + chain[0] - version
    return len(chain) - bisect.bisect_right(chain, version)


def version_dir_name(version: int) -> str:
    """``42 -> "v000042"``."""
    return f"v{version:06d}"


def _last_modified(folder: Path) -> float:
    """Newest modification time of ``folder`` and of everything under it."""
    newest = folder.stat().st_mtime
    for path in folder.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            newest = max(newest, path.stat().st_mtime)
    return newest


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a local file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _safetensors_ready(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors, a storage shared by several names (tied
    embeddings) stored once under its first name, as ``save_pretrained`` does.

    ``from_pretrained`` re-ties the missing name from the config; storing both copies
    instead makes the tie depend on the two copies comparing equal at load time.
    """
    # torch only where a version is written: reading the store (treadle inspect, the
    # maintain flow) starts without it
    import torch

    seen_tensors: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    seen_storages: set[int] = set()
    ready: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(tensor).__name__}, not a tensor")
        alias_key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if alias_key in seen_tensors:
            continue
        seen_tensors.add(alias_key)
        tensor = tensor.detach().to("cpu")
        storage = tensor.untyped_storage().data_ptr()
        # other views of an already stored buffer need their own copy (safetensors refuses shared memory)
        tensor = tensor.clone().contiguous() if storage in seen_storages else tensor.contiguous()
        seen_storages.add(storage)
        ready[name] = tensor
    return ready


def kept_float32(names: Iterable[str], model_config: Mapping, dtype: torch.dtype) -> set[str]:
    """The ``names`` that ``from_pretrained`` of ``model_config``'s model in ``dtype`` keeps in
    float32: those its Hugging Face class lists in ``_keep_in_fp32_modules_strict`` for bfloat16
    and float16 (the routers of GLM-4.5 and DeepSeek-V3), and in ``_keep_in_fp32_modules`` for
    float16; as ``rl.models.placed`` keeps them in the trainer. The class is the config's
    ``architectures``, or the causal LM of its ``model_type``; none for a class transformers
    does not have (a model of remote code)."""
    import transformers
    from transformers.core_model_loading import build_glob_alternation
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    classes = model_config.get("architectures") or [
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_config.get("model_type"))
    ]
    plan: dict = {}
    for class_name in filter(None, classes):
        model_class = getattr(transformers, class_name, None)
        if isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel):
            # the plan from_pretrained takes, from the class's lists alone (no model is built)
            plan |= transformers.PreTrainedModel._get_dtype_plan(model_class, dtype)
    if not plan:
        return set()
    pattern = build_glob_alternation(list(plan))[0]
    return {name for name in names if pattern.search(name)}


def _index(tensors: Mapping[str, torch.Tensor]) -> dict:
    """``model.safetensors.index.json`` of one file holding ``tensors``, as Hugging Face writes it."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(tensors, MODEL_FILE)}


def _is_plain_relative(name: str) -> bool:
    """Whether ``name`` stays inside the folder it is joined to: '/'-separated parts, none of
    them empty, '.' or '..', and no backslash."""
    return "\\" not in name and all(part not in ("", ".", "..") for part in name.split("/"))


def _check_extra_name(name: str) -> None:
    if not _is_plain_relative(name):
        raise ValueError(f"extra file name {name!r} must be a relative path without '.' or '..' parts")
    if name in RESERVED_FILES:
        raise ValueError(f"extra file name {name!r} is reserved for the store")


def tokenizer_fingerprint(tokenizer_json: bytes) -> str | None:
    """sha256 of the vocabulary and added tokens of a Hugging Face ``tokenizer.json``: the
    same for one tokenizer however it was serialised, different when any token's id is.
    None when the file holds no vocabulary."""
    try:
        data = json.loads(tokenizer_json)
        vocab = data["model"]["vocab"]
        added = sorted((token["id"], token["content"]) for token in data.get("added_tokens") or [])
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return None
    canonical = json.dumps([vocab, added], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def part_files(manifest: dict, part: Part) -> dict[str, str]:
    """The files of ``part`` (see ``PARTS``) of a version's ``manifest``: name -> sha256.

    A version published before manifests named their extra files counts every file as the
    policy's: its ``serving`` part is all of it.
    """
    files = manifest["files"]
    if part == "all":
        return dict(files)
    left_out = set(manifest.get("extra_files", []))
    if part == "tokenizer":
        left_out |= {MODEL_FILE, MODEL_INDEX_FILE}
    return {name: digest for name, digest in files.items() if name not in left_out}


class WeightStore:
    """Weight versions of one run, under ``<run>/<prefix>/``.

    Args:
        store: the run's storage (local folder or S3).
        prefix: folder inside the run: ``weights`` for the policy; another name (e.g.
            ``value``) keeps a second model's versions and ``LATEST`` apart.
        cache_dir: where loads put the versions they fetch (downloaded from S3, hard-linked
            from a local folder); defaults to ``$TREADLE_CACHE`` or ``~/.cache/treadle``.
        one_copy: a load deletes the other cached copies of its part, and ``release``
            every copy this store holds, unless another store (of any process) holds it in
            use: for a process that loads each new version for days (a rollout worker, an
            engine actor) or loads once (a trainer, an evaluation), whose cache would
            otherwise keep a copy per version while the store keeps them all
            (``keep_versions`` None). The copies a killed process or a load still running
            at ``release`` left go at the next such load.
    """

    def __init__(
        self,
        store: RunStore,
        cache_dir: str | os.PathLike | None = None,
        prefix: str = "weights",
        *,
        one_copy: bool = False,
    ):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix) or prefix in (".", ".."):
            raise ValueError(f"prefix must be one folder name, got {prefix!r}")
        self.store = store
        self.fs = store.fs
        self.prefix = prefix
        self.root = store.path(prefix)
        default_cache = os.environ.get("TREADLE_CACHE") or os.path.join(Path.home(), ".cache", "treadle")
        run_key = hashlib.sha256(store.uri.encode()).hexdigest()[:16]
        self.cache_dir = Path(cache_dir or default_cache) / prefix / run_key
        self.one_copy = one_copy
        self._in_use: dict[Part, tuple[int, Path]] = {}
        self._in_use_lock = threading.Lock()
        # a store made for one load lets its copy go once collected, not at the process's end
        weakref.finalize(self, _let_go, self._in_use)

    def version_path(self, version: int) -> str:
        """Store path (no scheme) of a version's directory."""
        return posixpath.join(self.root, version_dir_name(version))

    def version_url(self, version: int) -> str:
        """Full URL of a version's directory (what the ``weights`` Delta table records)."""
        return self.store.url(self.prefix, version_dir_name(version))

    # -- writing -------------------------------------------------------------------------

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        model_config: dict,
        tokenizer_dir: str | os.PathLike | None,
        *,
        step: int = 0,
        parent: int | None = None,
        metadata: dict | None = None,
        extra_files: Mapping[str, bytes] | None = None,
        tag: str | None = None,
        version: int | None = None,
        owner: str | None = None,
        dtype: torch.dtype | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> int:
        """Write a new version and point ``LATEST`` at it unless it names a newer one; returns
        its number.

        Args:
            state_dict: parameter name -> tensor (a tied tensor is stored once, under its first name).
            model_config: the Hugging Face config as a dict (``config.to_dict()``).
            tokenizer_dir: a local folder whose files (``tokenizer.json`` …) are copied in.
            step: optimizer step that produced these weights.
            parent: the version these weights were trained from.
            metadata: JSON-serialisable data kept in the manifest (e.g. consumed shard ids).
            extra_files: relative name -> bytes, stored beside the weights and checksummed.
            tag: a name that protects the version from ``retain``.
            version: publish exactly this number, or raise :class:`VersionTaken` when
                another publish claimed it; default: the next free number.
            owner: who publishes, the same on every attempt (e.g. a task run id): its own
                claim of ``version`` left without a manifest by an attempt that failed is
                taken back instead of raising :class:`VersionTaken`.
            dtype: store the floating-point tensors in this dtype (tied ones still once) and
                say so in ``config.json``, but those a load in ``dtype`` keeps in float32 in
                float32 (:func:`kept_float32`); default: as given.
            before_commit: called once the files are uploaded, just before the manifest makes
                the version complete; what it raises stops the publish, and the version stays
                incomplete, as a publish killed there leaves it (``retain`` deletes it).
        """
        if version is not None and version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        extra_files = dict(extra_files or {})
        for name in extra_files:
            _check_extra_name(name)
        try:
            metadata_json = json.loads(json.dumps(metadata or {}))
        except TypeError as error:
            raise ValueError(f"metadata must be JSON-serialisable: {error}") from error
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="treadle-publish-") as staging:
            tensors = _safetensors_ready(state_dict)
            if dtype is not None:
                import torch

                kept = kept_float32(tensors, model_config, dtype)
                tensors = {
                    name: t.to(torch.float32 if name in kept else dtype) if t.is_floating_point() else t
                    for name, t in tensors.items()
                }
                model_config = model_config | {"dtype": str(dtype).removeprefix("torch.")}
            save_file(tensors, os.path.join(staging, MODEL_FILE), metadata={"format": "pt"})
            Path(staging, MODEL_INDEX_FILE).write_text(json.dumps(_index(tensors), indent=2, sort_keys=True))
            Path(staging, CONFIG_FILE).write_text(json.dumps(model_config, indent=2, sort_keys=True))
            if tokenizer_dir is not None:
                self._stage_tokenizer(Path(tokenizer_dir), Path(staging))
            for name, payload in extra_files.items():
                path = Path(staging, name)
                try:
                    if path.exists():
                        raise FileExistsError(name)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(payload)
                except (FileExistsError, NotADirectoryError):
                    # written over a tokenizer file, it would also leave the engines' part (PARTS)
                    raise ValueError(
                        f"extra file name {name!r} clashes with a tokenizer file or another extra file "
                        "(they share a name, or one is a file where the other needs a folder)"
                    ) from None
            files = {
                path.relative_to(staging).as_posix(): sha256_file(path)
                for path in sorted(Path(staging).rglob("*"))
                if path.is_file()
            }
            version = self._claim(version, owner)  # after everything that can fail here
            target = self.version_path(version)
            with self._claim_kept_fresh(version, owner):
                for name in files:
                    self.fs.put_file(os.path.join(staging, name), posixpath.join(target, name))
                if not self.store.config.is_s3:
                    # on disk before the manifest makes the version complete: a power loss
                    # must not leave LATEST on a version whose files are empty
                    written = [posixpath.join(target, name) for name in files]
                    for path in [*written, *sorted({posixpath.dirname(path) for path in written})]:
                        fsync_path(path)
            tokenizer_json = Path(staging, TOKENIZER_FILE)
            fingerprint = (
                tokenizer_fingerprint(tokenizer_json.read_bytes()) if tokenizer_json.is_file() else None
            )
        if before_commit is not None:
            before_commit()
        manifest = {
            "version": version,
            "step": int(step),
            "parent": parent,
            "tag": tag,
            "created_at": datetime.now(UTC).isoformat(),
            "files": files,
            "extra_files": sorted(extra_files),
            "tokenizer_fingerprint": fingerprint,
            "metadata": metadata_json,
        }
        self._write_atomic(posixpath.join(target, MANIFEST_FILE), json.dumps(manifest, indent=2).encode())
        self._advance_latest(version)
        return version

    def _advance_latest(self, version: int) -> None:
        """Point ``LATEST`` at ``version`` unless it names a newer one. Another publish may
        have read the same old ``LATEST`` and written its newer number before this write:
        after writing, the newest complete version is written until ``LATEST`` names it
        (the last writer of ``LATEST`` always sees every manifest written before it)."""
        current = self._readable_latest()
        while current is None or version > current:
            self._write_atomic(posixpath.join(self.root, LATEST_FILE), f"{version}\n".encode())
            version, current = self._newest_complete(version), self.latest()

    def _readable_latest(self) -> int | None:
        """``latest()``, or None (with a warning) when ``LATEST`` is unreadable: a garbage
        ``LATEST`` names no version, so the next publish or recovery writes over it."""
        try:
            return self.latest()
        except CorruptVersion as error:
            log.warning("%s; taking it as naming no version", error)
            return None

    def recover_latest(self) -> int | None:
        """Point ``LATEST`` at the newest complete version when it names an older one, none,
        or holds no number (a publish that wrote its manifest and then failed to write
        ``LATEST``; a truncated or garbled ``LATEST``); returns it."""
        complete = self.list()
        if complete:
            self._advance_latest(complete[-1])
        return self._readable_latest()

    def load_newest(self, part: Part = "all") -> tuple[int, str]:
        """The newest version ``LATEST`` allows whose ``part`` verifies, and its local
        directory (as :meth:`load`): the one ``LATEST`` names or, when it is corrupt or
        missing, the newest complete version below it that verifies (any complete version
        when ``LATEST`` holds no number). Each version passed over is logged as a warning
        saying what is wrong with it. When every one fails and ``LATEST`` has moved on
        meanwhile (the trainer published newer versions and its retention deleted those being
        loaded), the versions up to the new ``LATEST`` are tried.

        Raises:
            FileNotFoundError: when no version is complete.
            CorruptVersion: when none verifies, naming what is wrong with each.
        """
        latest = self._readable_latest()
        candidates = [v for v in reversed(self.list()) if latest is None or v <= latest]
        if not candidates:
            raise FileNotFoundError(f"no weight version published in {self.store.url(self.prefix)}")
        problems = []
        while True:
            if latest is not None and candidates and candidates[0] != latest:
                problems.append(f"LATEST names weight version {latest}, which has no manifest")
                log.warning("%s; trying the versions below it", problems[-1])
            for version in candidates:
                try:
                    return version, self.load(version, part)
                except (CorruptVersion, KeyError) as error:  # KeyError: deleted meanwhile by retain
                    problems.append(str(error.args[0]))
                    log.warning("%s; trying the versions below it", problems[-1])
            # newer versions published meanwhile, their retention deleting those tried
            moved = self._readable_latest()
            if latest is None or moved is None or moved <= latest:
                break
            log.warning(
                "LATEST moved on to weight version %d meanwhile; trying the versions above %d", moved, latest
            )
            candidates = [v for v in reversed(self.list()) if latest < v <= moved]
            latest = moved
        raise CorruptVersion(
            f"no weight version of {self.store.url(self.prefix)} verifies ({'; '.join(problems)})"
        )

    def _newest_complete(self, known: int) -> int:
        """The newest complete version, ``known`` (complete) or a newer one: one listing, and
        manifests looked for only above ``known``."""
        numbers = (int(m.group(1)) for m in map(_VERSION_DIR.match, self._dir_names()) if m)
        for number in sorted((n for n in numbers if n > known), reverse=True):
            if self.fs.exists(posixpath.join(self.root, version_dir_name(number), MANIFEST_FILE)):
                return number
        return known

    def _stage_tokenizer(self, source: Path, staging: Path) -> None:
        """Copy the tokenizer's files, those in subfolders too (``save_pretrained`` keeps
        named chat templates in ``additional_chat_templates/``)."""
        if not source.is_dir():
            raise FileNotFoundError(f"tokenizer_dir {str(source)!r} is not a directory")
        for path in sorted(source.rglob("*")):
            name = path.relative_to(source).as_posix()
            if path.is_file() and name not in RESERVED_FILES:
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, staging / name)

    def _claim(self, version: int | None, owner: str | None = None) -> int:
        """Create ``CLAIM`` in the version's directory, failing if it exists: the number is
        then this publish's alone. Without a ``version``, a number claimed meanwhile by
        another publisher moves this one to the next."""
        number = self._next_version() if version is None else version
        while True:
            claim = posixpath.join(self.version_path(number), CLAIM_FILE)
            try:
                self.store.create_exclusive(claim, _claim_text(owner))
                return number
            except FileExistsError:
                if version is not None and owner is not None and self._failed_claim_of(owner, version):
                    # an earlier attempt of this publish claimed it, then failed: renewed now, as
                    # its time may be past what a waiting publisher or a retention takes for dead
                    self._write_atomic(claim, _claim_text(owner))
                    return version
                if version is not None:
                    raise VersionTaken(
                        f"weight version {version} of {self.store.url(self.prefix)} is claimed by another publish"
                    ) from None
                number += 1

    @contextlib.contextmanager
    def _claim_kept_fresh(self, version: int, owner: str | None) -> Iterator[None]:
        """Renew ``version``'s claim every ``CLAIM_REFRESH_S`` while the block runs (an upload
        of a large checkpoint can outlast any fixed wait of the publishers it beat); each
        renewal replaces the claim whole, so a reader never sees it empty and takes it for dead."""
        path = posixpath.join(self.version_path(version), CLAIM_FILE)
        renewer = Heartbeat(
            lambda: self._write_atomic(path, _claim_text(owner)),
            CLAIM_REFRESH_S,
            f"renewal of the claim of weight version {version}",
        )
        try:
            yield
        finally:
            renewer.stop()

    def _failed_claim_of(self, owner: str, version: int) -> bool:
        """Whether ``version`` was claimed by ``owner`` and never got its manifest."""
        directory = self.version_path(version)
        try:
            claim = self.fs.cat_file(posixpath.join(directory, CLAIM_FILE)).decode()
        except (FileNotFoundError, UnicodeDecodeError):
            return False
        return claim.endswith(f" owner {owner}\n") and not self.fs.exists(
            posixpath.join(directory, MANIFEST_FILE)
        )

    def _next_version(self) -> int:
        """One past every version directory present, complete or not (never reuse a name)."""
        numbers = [int(match.group(1)) for match in map(_VERSION_DIR.match, self._dir_names()) if match]
        latest = self._readable_latest()
        if latest is not None:
            numbers.append(latest)
        return max(numbers) + 1 if numbers else 0

    def _dir_names(self) -> list[str]:
        if not self.fs.exists(self.root):
            return []
        return [posixpath.basename(entry.rstrip("/")) for entry in self.fs.ls(self.root, detail=False)]

    def _write_atomic(self, path: str, payload: bytes) -> None:
        if self.store.config.is_s3:
            self.fs.pipe_file(path, payload)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(temp, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        fsync_path(os.path.dirname(path))

    # -- reading -------------------------------------------------------------------------

    def latest(self) -> int | None:
        """The newest complete version named by ``LATEST``, or None when nothing is published."""
        path = posixpath.join(self.root, LATEST_FILE)
        try:
            text = self.fs.cat_file(path).decode(errors="replace").strip()
        except FileNotFoundError:
            return None
        if not (text.isascii() and text.isdigit()):  # isdigit() takes "²", which int() refuses
            raise CorruptVersion(
                f"{self.store.url(self.prefix, LATEST_FILE)} holds {text!r}, not a version number"
            )
        return int(text)

    def list(self) -> list[int]:
        """Complete versions (those with a manifest), ascending. On S3 one listing of the
        prefix's files (a request per thousand), not a request per version: a worker lists at
        each load, and a run that keeps every version holds thousands."""
        if self.store.config.is_s3:
            if not self.fs.exists(self.root):  # an absent bucket too, whose listing raises
                return []
            names = [posixpath.relpath(path, self.root) for path in self.fs.find(self.root)]
        else:  # a local find passes over a folder it may not read: a run would list as empty
            names = [posixpath.join(name, MANIFEST_FILE) for name in self._dir_names()]
            names = [name for name in names if self.fs.exists(posixpath.join(self.root, name))]
        return sorted(int(match.group(1)) for match in map(_VERSION_MANIFEST.match, names) if match)

    def table_row(self, version: int) -> dict:
        """``version``'s row of the run's ``weights`` Delta table, from its manifest."""
        manifest = self.manifest(version)
        metadata = manifest.get("metadata", {})
        return {
            "version": version,
            "step": int(manifest.get("step", 0)),
            "parent": manifest.get("parent"),
            "path": self.version_url(version),
            "num_consumed_shards": len(metadata.get("consumed_shards", [])),
            "created_at": datetime.fromisoformat(manifest["created_at"]),
            "tag": manifest.get("tag"),
            "dropped_stale": metadata.get("dropped_stale"),
            "rejected_rows": metadata.get("rejected_rows"),
        }

    def record(self, tables: Tables, version: int) -> bool:
        """Append ``version``'s row to the run's ``weights`` table unless it has one; returns
        whether this call appended it.

        Its publisher and a trainer that resumes from it and finds its row missing (its
        publisher may have died before writing it, or be about to) both record a version:
        the row lands once, whichever writes first (see ``Tables.append``'s ``once``).
        """
        row_id = f"{self.prefix}/{version_dir_name(version)}"
        return tables.append("weights", [self.table_row(version)], once=row_id)

    def recent_chain(self, version: int, length: int, known: Sequence[int] = ()) -> list[int]:
        """``version`` and its newest ancestors (its manifest's ``parent``, and so on), ``length``
        at most, oldest first: what :func:`versions_ahead` counts on. ``known`` is such a chain
        read before (of an older version): the walk stops at a version it holds and takes that
        one's ancestors from it, so a new version's chain costs one manifest read."""
        chain = [version]
        while len(chain) < length:
            if chain[0] in known:
                at = known.index(chain[0])
                return [*known[max(0, at - (length - len(chain))) : at], *chain]
            try:
                parent = self.manifest(chain[0]).get("parent")
            except (KeyError, CorruptVersion):  # deleted by retention: numbers count beyond it
                break
            if parent is None:
                break
            chain.insert(0, parent)
        return chain

    def manifest(self, version: int) -> dict:
        """The parsed manifest of ``version``; ``KeyError`` if it was never completed."""
        path = posixpath.join(self.version_path(version), MANIFEST_FILE)
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            raise KeyError(
                f"weight version {version} does not exist in {self.store.url(self.prefix)}"
            ) from None
        return self._parse_manifest(raw, version)

    def _parse_manifest(self, raw: bytes, version: int) -> dict:
        try:
            manifest = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CorruptVersion(
                f"weight version {version}: {MANIFEST_FILE} is not valid JSON ({error})"
            ) from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise CorruptVersion(f"weight version {version}: {MANIFEST_FILE} has no 'files' table")
        for name, digest in manifest["files"].items():
            if not _is_plain_relative(name):
                raise CorruptVersion(
                    f"weight version {version}: {MANIFEST_FILE} lists {name!r}, "
                    "not a file name inside the version directory"
                )
            if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
                raise CorruptVersion(
                    f"weight version {version}: {MANIFEST_FILE} gives {name!r} the digest {digest!r}, "
                    "not a sha256 in hex"
                )
        extra = manifest.get("extra_files", [])
        if not isinstance(extra, list) or not all(
            isinstance(name, str) and name in manifest["files"] and name not in RESERVED_FILES
            for name in extra
        ):
            raise CorruptVersion(
                f"weight version {version}: {MANIFEST_FILE} gives extra_files {extra!r}, "
                "not a list of the extra files it holds"
            )
        unlisted = [name for name in (MODEL_FILE, CONFIG_FILE) if name not in manifest["files"]]
        if unlisted:
            raise CorruptVersion(
                f"weight version {version}: {MANIFEST_FILE} does not list {unlisted}, so they cannot be verified"
            )
        return manifest

    def load(self, version: int | None = None, part: Part = "all") -> str:
        """A local directory holding ``part`` of ``version`` (default: latest), those files verified.

        ``part`` (see ``PARTS``): ``"serving"`` for an engine or an evaluation, ``"tokenizer"``
        for a tokenizer alone, ``"all"`` for a trainer that resumes. The part's files are
        fetched into ``cache_dir`` (downloaded from S3; hard-linked from a local folder, copied
        where the cache is on another file system), so a retention deleting the version from
        the store leaves the caller's copy whole. A cached copy is re-used on the next call if
        it still verifies, as is a cached copy of a larger part, and a fetch deletes the cached
        versions the store no longer has (see ``retain``), and with ``one_copy`` the other copies
        of ``part``, either one only if no store holds it in use. Raises ``CorruptVersion`` naming the
        first file whose sha256 differs or that is missing; other versions are unaffected.
        Raises ``KeyError`` when the version does not exist, or is deleted (by ``retain``)
        while its files are fetched.

        Processes may share ``cache_dir`` (engines on one machine): the copy a load returns
        stays while this store lives and loads no other copy of ``part``, whatever the others'
        tidying does (a shared lock on the copy's ``.in-use`` file, let go of by that next
        load, by :meth:`release` or when the store is collected).
        """
        if part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {part!r}")
        if version is None:
            version = self.latest()
            if version is None:
                raise FileNotFoundError(f"no weight version published in {self.store.url(self.prefix)}")
        manifest = self.manifest(version)
        path = Path(self._fetch(version, manifest, part))
        self._use(part, path)
        while not path.is_dir():  # another store's ``one_copy`` deleted it before it was marked
            path = Path(self._fetch(version, manifest, part))
            self._use(part, path)
        # a tidy that took the copy before it was marked in use follows the version's deletion
        if not self.fs.exists(posixpath.join(self.version_path(version), MANIFEST_FILE)):
            raise KeyError(
                f"weight version {version} was deleted from {self.store.url(self.prefix)} "
                "while it was being loaded (by a retention: keep_versions, the maintain flow)"
            )
        try:
            self._forget_removed()
            if self.one_copy:
                for copy in self._copies(self._cached(version, part).parent):
                    self._forget_copy(copy)
        except OSError as exc:  # the copy itself is whole
            log.warning("could not tidy the weight cache %s: %s", self.cache_dir, exc)
        return str(path)

    def release(self) -> None:
        """Let go of the copies this store's loads hold (see :meth:`load`); with ``one_copy``,
        delete each one no other store holds. For a process done with what it loaded: an
        evaluation that ended, a trainer with its model and optimizer read, a worker that stops.
        The store stays usable: a later load fetches again."""
        with self._in_use_lock:
            held = list(self._in_use.values())
            self._in_use.clear()
        for handle, copy in held:
            os.close(handle)
            if self.one_copy:
                self._forget_copy(copy)

    @staticmethod
    def _in_use_file(copy: Path) -> Path:
        return copy.parent / f".{copy.name}.in-use"

    def _use(self, part: Part, copy: Path) -> None:
        """Mark ``copy`` in use by this store's ``part``, and the copy it held before not (with
        ``one_copy`` deleted, unless a store, this one's other parts included, uses it)."""
        marker = self._in_use_file(copy)
        while True:
            handle = os.open(marker, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(handle, fcntl.LOCK_SH)
            with contextlib.suppress(FileNotFoundError):
                # a tidy that deleted the file meanwhile: the lock would be on a name no one sees
                if os.fstat(handle).st_ino == os.stat(marker).st_ino:
                    break
            os.close(handle)
        with self._in_use_lock:
            before = self._in_use.get(part)
            self._in_use[part] = (handle, copy)
        if before is not None:
            os.close(before[0])
            if self.one_copy and before[1] != copy:
                self._forget_copy(before[1])

    def _cached(self, version: int, part: Part) -> Path:
        """Where ``part`` of ``version`` is cached (every file: the version's own folder)."""
        name = version_dir_name(version)
        return self.cache_dir / name if part == "all" else self.cache_dir / part / name

    def _fetch(self, version: int, manifest: dict, part: Part) -> str:
        files = part_files(manifest, part)
        final = self._cached(version, part)
        for larger in PARTS[: PARTS.index(part)]:
            cached = self._cached(version, larger)
            if cached.is_dir():
                with contextlib.suppress(CorruptVersion):  # its own load replaces it
                    self._verify(str(cached), files, version)
                    return str(cached)
        if final.is_dir():
            try:
                self._verify(str(final), files, version)
                return str(final)
            except CorruptVersion:
                with contextlib.suppress(FileNotFoundError):  # another store's tidy deleted it meanwhile
                    shutil.rmtree(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = self.cache_dir / f".{part}-{version_dir_name(version)}.tmp-{uuid.uuid4().hex}"
        try:
            for name in files:
                remote = posixpath.join(self.version_path(version), name)
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                try:
                    self._fetch_file(remote, staging / name)
                except (FileNotFoundError, IsADirectoryError):
                    if not self.fs.exists(posixpath.join(self.version_path(version), MANIFEST_FILE)):
                        raise KeyError(
                            f"weight version {version} was deleted from {self.store.url(self.prefix)} "
                            "while it was being loaded (by a retention: keep_versions, the maintain flow)"
                        ) from None
                    raise _missing_file(version, name) from None
            Path(staging, MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
            self._verify(str(staging), files, version)
            try:
                os.replace(staging, final)
            except OSError:
                if not final.is_dir():  # another process may have won the same download
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return str(final)

    def _fetch_file(self, stored: str, local: Path) -> None:
        """Put the store's file ``stored`` at ``local``: downloaded from S3; from a local
        folder a hard link (the file outlives its version's deletion), or a copy where the
        link cannot be made (another file system)."""
        if self.store.config.is_s3:
            self.fs.get_file(stored, str(local))
            return
        try:
            os.link(stored, local)
        except (FileNotFoundError, IsADirectoryError):
            raise
        except OSError:
            shutil.copyfile(stored, local)

    def _forget_removed(self) -> None:
        """Delete the cached copies of versions no longer in the store (deleted by ``retain``)
        that no store holds in use (see :meth:`load`), and the staging folders of downloads whose
        process died (untouched for :data:`STAGING_STALE_S`; one still downloading writes
        into its folder)."""
        kept = {version_dir_name(version) for version in self.list()}
        folders = [self.cache_dir / part for part in PARTS[1:] if (self.cache_dir / part).is_dir()]
        for folder in [self.cache_dir, *folders]:
            for copy in self._copies(folder):
                if copy.name not in kept:
                    self._forget_copy(copy)
        stale_before = time.time() - STAGING_STALE_S
        for staging in self.cache_dir.iterdir():
            if not _STAGING_DIR.match(staging.name):
                continue
            with contextlib.suppress(FileNotFoundError):  # its download finished meanwhile
                if _last_modified(staging) < stale_before:
                    shutil.rmtree(staging, ignore_errors=True)

    @staticmethod
    def _copies(folder: Path) -> list[Path]:
        """The version copies cached in ``folder`` (none where it is not made yet), found by
        their folder or their in-use file."""
        if not folder.is_dir():
            return []
        names = set()
        for entry in folder.iterdir():
            marker = _IN_USE_FILE.match(entry.name)
            if marker or _VERSION_DIR.match(entry.name):
                names.add(marker.group(1) if marker else entry.name)
        return [folder / name for name in sorted(names)]

    def _forget_copy(self, copy: Path) -> None:
        """Delete ``copy`` and its in-use file, unless a store (of any process) holds it in use."""
        marker = self._in_use_file(copy)
        handle = os.open(marker, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            shutil.rmtree(copy, ignore_errors=True)
            marker.unlink(missing_ok=True)
        finally:
            os.close(handle)

    @staticmethod
    def _verify(local_dir: str, files: dict[str, str], version: int) -> None:
        """Check that each of ``files`` (name -> sha256) is in ``local_dir`` with its digest."""
        for name, expected in files.items():
            path = os.path.join(local_dir, name)
            try:
                actual = sha256_file(path)
            # missing, or deleted meanwhile by the tidy of another store sharing the cache
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise _missing_file(version, name) from None
            if actual != expected:
                raise _corrupt_file(version, name, actual, expected)

    def _verify_stored(self, version: int) -> None:
        """Check every file of ``version`` against its manifest where the store keeps it,
        read through without caching a copy; raises as :meth:`load`."""
        directory = self.version_path(version)
        for name, expected in self.manifest(version)["files"].items():
            digest = hashlib.sha256()
            try:
                with self.fs.open(posixpath.join(directory, name), "rb") as handle:
                    while chunk := handle.read(_HASH_CHUNK):
                        digest.update(chunk)
            except (FileNotFoundError, IsADirectoryError):
                raise _missing_file(version, name) from None
            if digest.hexdigest() != expected:
                raise _corrupt_file(version, name, digest.hexdigest(), expected)

    # -- retention -----------------------------------------------------------------------

    def claim_age(self, version: int) -> float:
        """Seconds since ``version``'s claim was made or last renewed by its publish
        (infinite without a readable claim: none, a garbled one, or a file that holds the
        version's name where its folder would be)."""
        try:
            claimed = self.fs.cat_file(posixpath.join(self.version_path(version), CLAIM_FILE)).decode()
            made = datetime.fromisoformat(claimed.split()[0])
        except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError, ValueError, IndexError):
            return float("inf")
        if made.tzinfo is None:  # every claim holds its UTC offset: a time without one is garbled
            return float("inf")
        return (datetime.now(UTC) - made).total_seconds()

    def _verifies(self, version: int) -> bool:
        """Whether every file of ``version`` matches its manifest in the store (why not: logged)."""
        try:
            self._verify_stored(version)
        except (CorruptVersion, KeyError) as error:  # KeyError: deleted meanwhile by another retention
            log.warning("retention keeps the versions down to one that verifies: %s", error.args[0])
            return False
        return True

    def retain(
        self, keep_last: int, in_flight_s: float = IN_FLIGHT_S, verified: int | None = None
    ) -> list[int]:
        """Delete all but the newest ``keep_last`` versions; tagged versions and LATEST stay,
        and so does a version whose manifest is unreadable (it may be tagged; logged). So do the
        newest version at or below LATEST (any, when LATEST holds no number) whose files all
        verify (what ``load_newest`` finds) and every version above it: when the newest
        ``keep_last`` do not verify, the run still has the weights its trainer and workers start
        from. That version is found by reading the versions' files whole, from LATEST down,
        whenever a version at or below LATEST would otherwise be deleted (so a retention that
        prunes anything reads at least LATEST's checkpoint, optimizer state included);
        ``verified`` names a version known to verify (one this process has just published,
        hashed as it was written), taken as it is without reading it.

        Incomplete directories below the newest complete version (left by a crashed
        publish) are deleted too once claimed more than ``in_flight_s`` ago: a publish that
        is still uploading keeps its directory. Returns the version numbers removed, ascending.
        """
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        complete = self.list()
        keep = set(complete[-keep_last:])
        latest = self._readable_latest()
        if latest is not None:
            keep.add(latest)
        loadable = [v for v in reversed(complete) if latest is None or v <= latest]
        if not keep.issuperset(loadable):
            for version in loadable:
                keep.add(version)
                if version == verified or self._verifies(version):
                    break
        for version in complete:
            if version in keep:
                continue
            try:
                tagged = self.manifest(version).get("tag")
            except KeyError:  # deleted meanwhile by another retention (a trainer's, the maintain flow's)
                continue
            except CorruptVersion as error:
                log.warning("retention keeps weight version %d, whose tag cannot be read: %s", version, error)
                tagged = True
            if tagged:
                keep.add(version)
        newest = max(complete, default=-1)
        present = {int(m.group(1)) for m in map(_VERSION_DIR.match, self._dir_names()) if m}
        doomed = sorted(
            v
            for v in present
            if v not in keep and (v in complete or (v < newest and self.claim_age(v) > in_flight_s))
        )
        for version in doomed:
            path = self.version_path(version)
            manifest_path = posixpath.join(path, MANIFEST_FILE)
            with contextlib.suppress(FileNotFoundError):  # another retention deleted it meanwhile
                if self.fs.exists(manifest_path):
                    self.fs.rm_file(manifest_path)  # the version disappears before its files do
                self.fs.rm(path, recursive=True)
        return doomed

    def sweep_latest_temps(self, older_than_s: float = IN_FLIGHT_S) -> list[str]:
        """Delete the temporary files of ``LATEST``, and of each version's ``CLAIM`` and
        manifest (written on a local folder, then moved into place), that publishes killed
        before the move left, once older than ``older_than_s``; returns their names (a
        version's as ``v000042/CLAIM.tmp-<hex>``), sorted. A kept version would keep its own
        for ever. On S3 nothing writes them (each is one PUT): the versions' folders are not
        listed there."""
        stale_before = time.time() - older_than_s
        names = self._dir_names()
        temps = list(filter(_LATEST_TEMP.match, names))
        if not self.store.config.is_s3:
            for folder in filter(_VERSION_DIR.match, names):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # deleted by a retention
                    inside = self.fs.ls(posixpath.join(self.root, folder), detail=False)
                    temps += [
                        posixpath.join(folder, name)
                        for name in map(posixpath.basename, inside)
                        if _VERSION_TEMP.match(name)
                    ]
        swept = []
        for name in sorted(temps):
            path = posixpath.join(self.root, name)
            with contextlib.suppress(FileNotFoundError):  # another sweep deleted it meanwhile
                if self.fs.modified(path).timestamp() < stale_before:
                    self.fs.rm_file(path)
                    swept.append(name)
        return swept
