"""``shell``: a persistent bash in a sandbox directory; the work is checked at EVAL.

Three kinds of task: ``put hello in a.txt`` (checked: the file's content), ``which file has
KEY?`` and ``how many files in d1?`` (answered with ``answer: ...``). Every other action is a
shell command (written in Markdown code blocks, the last block's); the observation is its
output (past ``max_observation_chars``, its end, after a line saying how many characters were
cut) and, when it failed, ``[exit N]``, or ``[stopped: KIND: ...]`` when the sandbox stopped
it (a shell it killed starts afresh, in the directory the last command that ended left).
``done`` ends the episode without an answer.
"""

from __future__ import annotations

import asyncio
import os
import random
import stat

from pydantic import Field

from envs.base import (
    Env,
    EnvConfig,
    ResourceRequest,
    Split,
    StepResult,
    Task,
    fenced_blocks,
    in_eval_split,
    sample_unique,
    stopped,
    tail,
    user,
)
from envs.sandbox import SandboxError
from envs.shell import Shell
from envs.threads import to_thread_to_the_end

MAX_CHECKED_BYTES = 4096
"""The longest file a ``write`` task's check reads; a longer one fails it."""
WORDS = ("red", "sun", "cat", "map", "owl", "fig", "ice", "jam", "kit", "log", "net", "oak", "pen", "rug")


class ShellConfig(EnvConfig):
    """Turn budget and observation size of ``shell``."""

    max_turns: int = Field(4, ge=1, description="Commands allowed, the answer included.")
    max_observation_chars: int = Field(300, ge=16, description="Command output shown back to the model.")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Share of tasks held out for eval.")


def split_key(task: Task) -> str:
    """What decides a task's answer, which names its split.

    The words in the files do not decide a ``count`` or ``find`` answer: keyed by them, a
    held-out task had train twins with the same question, file names and answer.
    """
    data = task.data
    if data["kind"] == "write":
        return task.id
    return f"{task.prompt}:{sorted(data['files'])}:{data['answer']}"


def _make_task(rng: random.Random) -> Task:
    kind = rng.choice(("write", "find", "count"))
    if kind == "write":
        word, name = rng.choice(WORDS), rng.choice("abcdefgh")
        return Task(
            env="shell",
            id=f"write:{word}:{name}",
            prompt=f"put {word} in {name}.txt",
            data={"kind": kind, "file": f"{name}.txt", "content": word},
        )
    files = {}
    for d in ("d1", "d2"):
        for i in range(rng.randint(1, 4)):
            files[f"{d}/f{i}.txt"] = rng.choice(WORDS[:6])
    if kind == "count":
        d = rng.choice(("d1", "d2"))
        count = sum(1 for path in files if path.startswith(d + "/"))
        return Task(
            env="shell",
            id=f"count:{d}:{sorted(files.items())}",
            prompt=f"how many files in {d}?",
            data={"kind": kind, "files": files, "answer": str(count)},
        )
    key = rng.choice(WORDS[6:])
    path = rng.choice(sorted(files))
    files[path] = key
    return Task(
        env="shell",
        id=f"find:{sorted(files.items())}",
        prompt=f"which file has {key}?",
        data={"kind": kind, "files": files, "answer": path},
    )


class ShellEnv(Env):
    """Work in a persistent shell; reward 1 when the file or answer is right (EVAL)."""

    name = "shell"
    config_cls = ShellConfig
    makes_sandboxes = True

    @classmethod
    def tasks(cls, split: Split, seed: int, n: int, config: ShellConfig | None = None) -> list[Task]:
        cfg = config or ShellConfig()

        def accept(task: Task) -> bool:
            return in_eval_split(split_key(task), cfg.eval_fraction) == (split == "eval")

        return sample_unique(random.Random(f"{seed}/{split}"), _make_task, accept, n)

    @classmethod
    def demonstrate(cls, task: Task, flawed: bool = False, seed: int = 0) -> list[str]:
        """Scripted commands (``flawed``: half the time skips the work and ends)."""
        if flawed and random.Random(f"{seed}/{task.id}").random() < 0.5:
            return ["done"]
        data = task.data
        if data["kind"] == "write":
            return [f"echo {data['content']} > {data['file']}", "done"]
        if data["kind"] == "count":
            return [f"ls {task.prompt.split()[-1].rstrip('?')} | wc -l", f"answer: {data['answer']}"]
        return [f"grep -rl {task.prompt.split()[-1].rstrip('?')} .", f"answer: {data['answer']}"]

    async def reset(self, task: Task) -> list[dict[str, str]]:
        self._start(task)
        require_task_data(task)
        sandbox = await self._new_sandbox()
        for path, content in task.data.get("files", {}).items():
            write_task_file(sandbox.workdir, path, content, sandbox.uid)
        self.shell = await to_thread_to_the_end(Shell, sandbox, discard=Shell.close)
        self.answer: str | None = None
        return user(task.prompt)

    async def close(self) -> None:
        """Close the shell (its pty, its process reaped), then the sandbox; safe to call twice."""
        try:
            await self._close_process("shell")
        finally:  # a cancel leaves the shell closing on its thread, not the sandbox
            await super().close()

    def action_request(self, action: str) -> ResourceRequest | None:
        """A command runs in the shell on one core; an answer or ``done`` needs nothing."""
        text = action.strip()
        if text.startswith("answer:") or text == "done":
            return None
        return ResourceRequest(demand={"cpu": 1}, kind="shell.command")

    def resource_pid(self) -> int | None:
        shell = getattr(self, "shell", None)
        return shell.proc.pid if shell is not None and shell.alive else None

    async def step(self, action: str) -> StepResult:
        self._next_turn()
        text = action.strip()
        if text.startswith("answer:"):
            self.answer = text.removeprefix("answer:").strip()
            return self._ended(StepResult([], 0.0, True, 0.0, {"scored_at": "eval"}))
        if text == "done":
            return self._ended(StepResult([], 0.0, True, 0.0, {"scored_at": "eval"}))
        done = self.turns >= self.config.max_turns
        # run with its fences, bash takes them for command substitutions
        command = (fenced_blocks(text) or [text])[-1]
        try:
            result = await asyncio.to_thread(self.shell.run, command)
        except SandboxError as exc:
            if not self._by_action(exc):
                raise
            if not self.shell.alive:
                self.shell = await to_thread_to_the_end(
                    Shell, self.sandbox, self.shell.cwd, discard=Shell.close
                )
            shown = stopped(exc, self.config.max_observation_chars)
            return self._ended(StepResult(user(shown), 0.0, done, 0.0, {"stopped": exc.kind}))
        shown = tail(result.output.strip(), self.config.max_observation_chars)
        if result.exit_code:
            shown = f"{shown}\n[exit {result.exit_code}]".strip()
        return self._ended(
            StepResult(user(shown or "(no output)"), 0.0, done, 0.0, {"exit_code": result.exit_code})
        )

    async def evaluate(self) -> float:
        task = self._require_task()
        data = task.data
        if data["kind"] == "count":
            return float(self.answer == data["answer"])
        workdir = None if self.sandbox is None else self.sandbox.workdir
        if data["kind"] == "find":
            return float(self.answer is not None and answered_path(self.answer, workdir) == data["answer"])
        if workdir is None:
            return 0.0
        # a byte more: a file longer than what is read is not the word, whatever it starts with
        content = await asyncio.to_thread(
            read_regular_file, self.sandbox.workdir, data["file"], MAX_CHECKED_BYTES + 1
        )
        return float(
            content is not None
            and len(content) <= MAX_CHECKED_BYTES
            and content.strip() == data["content"].encode()
        )


def write_task_file(workdir: str, path: str, content: str, uid: int | None) -> None:
    """Write ``content`` and a line break to ``path`` in ``workdir``, the file and every folder
    made for it given to ``uid`` (the sandbox's, when the worker is root) for the model to change."""
    parts = path.split("/")
    folder = workdir
    for part in parts[:-1]:
        folder = os.path.join(folder, part)
        os.makedirs(folder, exist_ok=True)
        if uid is not None:
            os.chown(folder, uid, uid)
    full = os.path.join(folder, parts[-1])
    with open(full, "w", encoding="utf-8") as handle:
        handle.write(content + "\n")
    if uid is not None:
        os.chown(full, uid, uid)


def answered_path(answer: str, workdir: str | None) -> str:
    """The file ``answer`` names, as a path from ``workdir``: ``./d1/f0.txt`` and the absolute
    path a command run in it prints (``grep -rl KEY "$PWD"``) both name ``d1/f0.txt``; an
    absolute path stays one once the sandbox (``workdir`` None) is gone."""
    path = os.path.normpath(answer)
    return os.path.relpath(path, workdir) if workdir is not None and os.path.isabs(path) else path


def require_task_data(task: Task) -> None:
    """Raise ValueError unless ``task.data`` is a task of this env: a known ``kind``; for
    ``write`` the ``file`` to check and its ``content``; else the ``files`` to write (path to
    text) and the ``answer``. Every path must stay in the working directory: a task sent by a
    client with ``../`` or an absolute path in ``files`` had the worker, as root, write there;
    and none of ``files`` may be a folder of another (its write failed with an OSError)."""
    data = task.data
    kind = data.get("kind")
    if kind == "write":
        problem = _path_problem(data.get("file")) or (
            None if isinstance(data.get("content"), str) else "content must be a text"
        )
    elif kind in ("find", "count"):
        files = data.get("files")
        if not isinstance(files, dict) or not all(isinstance(text, str) for text in files.values()):
            problem = "files must map paths to texts"
        else:
            problem = (
                next(filter(None, map(_path_problem, files)), None)
                or _folder_clash(files)
                or (None if isinstance(data.get("answer"), str) else "answer must be a text")
            )
    else:
        problem = f"kind must be write, find or count, got {kind!r}"
    if problem is not None:
        raise ValueError(f"shell task {task.id!r}: {problem}")


def _path_problem(path: object) -> str | None:
    """Why ``path`` is no path inside the working directory, or None."""
    if not isinstance(path, str) or not path or "\0" in path:
        return f"a path must be a non-empty text without NUL, got {path!r:.200}"
    if path.startswith("/") or any(part in ("", ".", "..") for part in path.split("/")):
        return f"a path must be relative, without empty, '.' or '..' parts, got {path!r:.200}"
    return None


def _folder_clash(paths: dict[str, str]) -> str | None:
    """Why ``paths`` cannot all be written (one names a folder of another), or None."""
    folders = {path.rsplit("/", i)[0] for path in paths for i in range(1, path.count("/") + 1)}
    clash = next((path for path in paths if path in folders), None)
    return None if clash is None else f"{clash!r:.200} is both a file and a folder of another file"


def read_regular_file(workdir: str, path: str, size: int) -> bytes | None:
    """The first ``size`` bytes of ``path`` (relative, in ``workdir``) if it is a regular file
    there, else None.

    What the model left running in the sandbox may swap the file, or a folder on its way, for a
    FIFO or a link at any moment: no open blocks on a FIFO or follows a link (a folder linked to
    a host path had the worker, as root, read the host's file), and the type is checked on the
    file actually opened.
    """
    *folders, name = path.split("/")
    try:
        fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        for folder in folders:
            inner = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        file = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return os.read(file, size) if stat.S_ISREG(os.fstat(file).st_mode) else None
    finally:
        os.close(file)
