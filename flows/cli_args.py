"""The command line every flow module shares: ``python -m flows.<flow> --config FILE``."""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import re
import signal
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

import yaml
from pydantic import BaseModel, SecretStr

from envs.base import Split
from envs.registry import REGISTRY
from flows.config import (
    ConfigError,
    EnvsConfig,
    Replacement,
    RunConfig,
    load_config,
    missing_device,
    missing_gateway_token,
    missing_path,
    missing_ray,
    read_yaml,
    rollout_problem,
    too_few_demos,
    unreachable_ray,
    yaml_problem,
)

DEFAULT_CONFIG = "configs/tiny.yaml"
REPO_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), DEFAULT_CONFIG)
"""The repository's copy of the default config, beside the ``flows`` package."""


def default_config() -> str:
    """``configs/tiny.yaml`` of the current directory when there is one, else the repository's."""
    return DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else REPO_CONFIG


PREFECT_DEFAULTS = {
    # a fresh Prefect home migrates its database on the first start: slow on a busy machine
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # the server's telemetry cannot reach its host from an offline machine, and its first
    # write races the other start-up writes on a fresh SQLite database
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


def set_prefect_defaults() -> None:
    """Set each of :data:`PREFECT_DEFAULTS` the environment does not set, for the temporary
    Prefect server a flow command starts (:func:`flows.cli.temporary_api`, which waits the
    ephemeral start-up timeout for it)."""
    unset = {name: value for name, value in PREFECT_DEFAULTS.items() if name not in os.environ}
    os.environ.update(unset)
    if unset and "prefect.context" in sys.modules:
        # the flow's module imported Prefect, which read its settings from the environment then
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


def flow_command(main: Callable[..., None]) -> Callable[..., None]:
    """``main``, a flow's command (``python -m flows.<flow>``, ``treadle run <flow>``), made to
    take SIGTERM (``docker stop``, Kubernetes, systemd) and SIGHUP (its terminal closed) as it
    takes Ctrl-C: the flow run ends Crashed, its tasks' cleanup runs, and the command's
    temporary Prefect server (:func:`flows.cli.temporary_api`) is stopped at exit. Killed by
    Python's default action, the process left that server running, orphaned. Each signal ends
    it with one line, no traceback, and the status a shell gives a process killed by the
    signal; so does a Prefect API that is not there or went away
    (:func:`flows.cli.exit_on_prefect_api_error`), with status 1."""

    @functools.wraps(main)
    def command(*args, **kwargs) -> None:
        received = [signal.SIGINT]

        def interrupt(signum, frame) -> None:
            received.append(signal.Signals(signum))
            raise KeyboardInterrupt

        # a signal ignored stays so: ``nohup`` ignores SIGHUP for the run to outlive its terminal
        previous = {
            signum: signal.signal(signum, interrupt)
            for signum in (signal.SIGTERM, signal.SIGHUP)
            if signal.getsignal(signum) is not signal.SIG_IGN
        }
        try:
            main(*args, **kwargs)
        except KeyboardInterrupt:
            print(f"stopped by {received[-1].name}", file=sys.stderr)
            raise SystemExit(128 + received[-1]) from None
        except Exception as exc:
            from flows.cli import exit_on_prefect_api_error

            exit_on_prefect_api_error(exc)
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    return command


def parse(
    description: str,
    argv: list[str] | None = None,
    extra=None,
    devices: Callable[[RunConfig], dict[str, str]] | None = None,
    paths: Callable[[RunConfig], str | None] | None = missing_path,
    ray: bool = False,
    splits: tuple[Split, ...] = (),
    warm_starts: bool = False,
    serves_gateway: bool = False,
) -> tuple[RunConfig, argparse.Namespace]:
    """Parse ``--config``, ``--run-id`` and ``--set a.b=value`` overrides; exit with the
    config error's message (naming the field) when it does not load, or when a field of
    ``devices(config)`` (field -> torch device: those the flow uses in this process, on
    either cluster) names a CUDA device this machine lacks, or ``paths(config)`` names a
    local path of the config that is missing (:func:`~flows.config.missing_path`, with what
    the flow reads; None: a flow that reads none), or, for a flow that runs on Ray (``ray``),
    the config asks for Ray and this machine lacks the extra (:func:`~flows.config.missing_ray`)
    or nothing answers at its ``ray_address`` (:func:`~flows.config.unreachable_ray`),
    or, for a flow that rolls out and draws tasks of ``splits``, what
    :func:`~flows.config.rollout_problem` finds (a task it cannot draw, more cores than this
    process may use, a reward model past its budget), or, for a flow that may warm-start
    (``warm_starts``), more demonstrations asked of an env than it holds train tasks
    (:func:`~flows.config.too_few_demos`), or, for a flow whose rollout worker may serve the
    gateway's HTTP API (``serves_gateway``), its bearer token missing from this machine's
    environment (:func:`~flows.config.missing_gateway_token`)."""
    set_prefect_defaults()
    from flows.run_logs import one_line_per_unsent_event  # imports Prefect: after its defaults

    one_line_per_unsent_event()
    parser = argparse.ArgumentParser(prog=_prog(), description=description)
    parser.add_argument(
        "--config",
        help=f"Run config YAML (default: {DEFAULT_CONFIG} in the current directory, else {REPO_CONFIG}).",
    )
    parser.add_argument("--run-id", help="Override run_id.")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a field, e.g. stop.max_seconds=60. A mapping given for a section (sao={lr: 1e-4}) "
        "changes the fields it names; one given for a mapping field (orchestrator.mix={arith: 1.0}) is its "
        "whole value.",
    )
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    overrides: dict = {}
    dotted: set[str] = set()  # sections some --set reached into
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            named = re.match(r"[\w.]*", item).group()  # not what follows: a value (``key: secret``)
            parser.error(f"--set needs KEY=VALUE: no '=' after {named!r}")
        node = overrides
        *parents, leaf = key.split(".")
        if not all((*parents, leaf)):
            parser.error(f"--set {key!r}: a field's name has an empty part")
        for depth in range(1, len(parents) + 1):
            section = ".".join(parents[:depth])
            if _holds_a_list(_annotation(section)):
                parser.error(f"--set {key}: {section} is a list, which --set sets whole: {section}=[...]")
        for depth, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                parser.error(
                    f"--set {key}: {'.'.join(parents[: depth + 1])} is set to a value, not a section"
                )
        if key in dotted:
            parser.error(f"--set {key}: fields inside {key} are set by another --set")
        if (unknown := _unknown_field(key)) is not None:
            parser.error(f"--set {key}: {unknown}")
        dotted.update(".".join(parents[:depth]) for depth in range(1, len(parents) + 1))
        annotation = _annotation(key)
        if _text_only(annotation) and not value.lstrip().startswith(("'", '"')):
            # a run id, a path, a shell command: YAML read 2024 as a number, '[ -f x ] && y' as
            # a list that does not parse, 'echo a: b' as a mapping, 'echo done #1' as 'echo done'
            parsed = None if _NULL.fullmatch(value.strip()) else value.strip()
        else:
            try:
                parsed = read_yaml(value)
            except yaml.YAMLError as exc:
                parser.error(f"--set {key}: its value is not YAML ({yaml_problem(exc)})")
        if isinstance(parsed, dict):
            parsed = _replacing(parsed, annotation)
        node[leaf] = parsed
        for field in _secrets_in(key, parsed, annotation):
            print(
                f"warning: --set {field} puts a secret on the command line, where ps and the shell's "
                "history show it: give it in the config file or the environment instead",
                file=sys.stderr,
            )
    if args.run_id is not None:  # an empty one is refused, not taken for none: it names no run
        overrides["run_id"] = args.run_id
    try:
        config = load_config(args.config or default_config(), overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    problem = (
        (missing_device(devices(config)) if devices else None)
        or ((missing_ray(config) or unreachable_ray(config)) if ray else None)
        or (paths(config) if paths else None)
        or (rollout_problem(config, splits) if splits else None)
        or (too_few_demos(config) if warm_starts else None)
        or (missing_gateway_token(config) if serves_gateway else None)
    )
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return config, args


def _prog() -> str | None:
    """``python -m flows.<flow>`` where the flow's module runs as ``__main__`` (argparse named
    its file, ``evaluate.py``: a command that runs nothing); None, argparse's own, otherwise
    (``treadle run <flow>`` names itself in ``sys.argv``)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    file = getattr(main, "__file__", None)
    if spec is None or file is None or not sys.argv or os.path.abspath(sys.argv[0]) != os.path.abspath(file):
        return None
    return f"python -m {spec.name.removesuffix('.__main__')}"


_NULL = re.compile(r"~|null|Null|NULL|")
"""What YAML reads as null: a text field that may be unset is unset by it."""


def _annotation(key: str) -> Any:
    """The type of the :class:`RunConfig` field that dotted ``key`` names (a registered
    environment's fields and a mapping field's entries included), None when it names none. A mapping given for a field of
    type ``dict`` (``orchestrator.mix``) replaces it; one given for a section (a model, or a
    model or None: ``envs.agent``) merges into it."""
    annotation: Any = RunConfig
    for name in key.split("."):
        model = _section_model(annotation)
        if model is not None:
            annotation = _field_type(model, name)
        elif (values := _mapping_values(annotation)) is not None:
            annotation = values
        else:
            return None
    return annotation


def _unknown_field(key: str) -> str | None:
    """Why dotted ``key`` names no field: the first of its parts that a section refusing
    unknown fields lacks, and the name of that section nearest to it (the config's own error
    named none: "Extra inputs are not permitted"); None when it may name one (what a value
    or a mapping's entries take is left to the config's validation)."""
    annotation: Any = RunConfig
    parts = key.split(".")
    for depth, name in enumerate(parts):
        model = _section_model(annotation)
        if model is None:
            annotation = _mapping_values(annotation)
            if annotation is None:
                return None
            continue
        annotation = _field_type(model, name)
        if annotation is None and model.model_config.get("extra") == "forbid":
            section = ".".join(parts[:depth])
            names = sorted({field.alias or field_name for field_name, field in model.model_fields.items()})
            nearest = difflib.get_close_matches(name, names, n=1)
            hint = (
                f"did you mean {'.'.join([*parts[:depth], nearest[0]])}?"
                if nearest
                else f"its fields: {', '.join(names)}"
            )
            return f"{section or 'the run config'} has no field {name!r}; {hint}"
        if annotation is None:
            return None
    return None


def _mapping_values(annotation: Any) -> Any:
    """The type of the values of a mapping field of this type (``dict[str, V]``, or that or
    None): what a key inside it (``envs.code.sandbox.env.PORT``) is set to; None when it holds
    no mapping."""
    for kind in _kinds(annotation):
        if typing.get_origin(kind) is dict:
            return typing.get_args(kind)[1]
    return None


def _replacing(value: Any, annotation: Any) -> Any:
    """``value``, given for a field of type ``annotation``, with each mapping in it that lands
    on a mapping field made a :class:`Replacement` (that field's whole value), whether given
    for the field itself (``orchestrator.mix={arith: 1.0}``) or inside a section's mapping
    (``orchestrator={mix: {arith: 1.0}}``); a section's own mapping still merges."""
    if not isinstance(value, dict):
        return value
    if any(typing.get_origin(kind) is dict for kind in _kinds(annotation)):
        return Replacement(value)
    model = _section_model(annotation)
    if model is None:
        return value
    return {name: _replacing(inner, _field_type(model, name)) for name, inner in value.items()}


def _field_type(model: type[BaseModel], name: str) -> Any:
    """The type of ``model``'s field ``name``, None when it has none. The ``envs`` section
    also takes an environment registered under its name, whose type is its config model."""
    field = model.model_fields.get(name)
    if field is not None:
        return field.annotation
    return REGISTRY[name].config_cls if model is EnvsConfig and name in REGISTRY else None


def _kinds(annotation: Any) -> set:
    """The types a field of this type may hold: each member of a union, else the type itself."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return set(typing.get_args(annotation) if union else [annotation])


def _secrets_in(key: str, value: Any, annotation: Any) -> list[str]:
    """The fields holding a secret (``SecretStr``) that ``value``, given for the field
    ``key`` of type ``annotation``, sets: the field itself, or fields of a section or of a
    list's sections."""
    kinds = _kinds(annotation)
    if SecretStr in kinds:
        return [key]
    model = _section_model(annotation)
    if model is not None and isinstance(value, dict):
        return [
            secret
            for name, inner in value.items()
            for secret in _secrets_in(f"{key}.{name}", inner, _field_type(model, name))
        ]
    if _holds_a_list(annotation) and isinstance(value, list):
        (item,) = [typing.get_args(kind)[0] for kind in kinds if typing.get_origin(kind) is list]
        return [secret for i, inner in enumerate(value) for secret in _secrets_in(f"{key}[{i}]", inner, item)]
    return []


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field of this type holds (``Model``, or ``Model`` or None), None when it
    holds none."""
    kinds = _kinds(annotation) - {type(None)}
    if len(kinds) != 1:
        return None
    (kind,) = kinds
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def _holds_a_list(annotation: Any) -> bool:
    """Whether a field of this type holds a list (``list[X]``, or that or None)."""
    return any(typing.get_origin(kind) is list for kind in _kinds(annotation))


def _text_only(annotation: Any) -> bool:
    """Whether a field of this type holds text and nothing else (``str``, a secret, a choice
    of words such as ``Literal["no", "bf16"]``, whose ``no`` YAML reads as false, or either
    or None)."""
    kinds = _kinds(annotation) - {type(None)}
    return bool(kinds) and all(kind in (str, SecretStr) or _words(kind) for kind in kinds)


def _words(kind: Any) -> bool:
    """Whether ``kind`` is a choice of words (a ``Literal`` of strings alone)."""
    return typing.get_origin(kind) is Literal and all(isinstance(word, str) for word in typing.get_args(kind))
