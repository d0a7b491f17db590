"""Parsing: flags, YAML files and the saved config of a run to resume, through one parser.

A YAML mapping is turned into the flags that say the same thing and parsed with the command line
by the same parser (tyro), so `lr: 1e-4` in a file is exactly `--lr 1e-4`, and a bad value is one
line naming the field and where it came from, wherever it came from. Flags given on the command
line override the file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import io
import types
import typing
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import tyro
import yaml

from grouprl.config.options import TrainConfig, field_names
from grouprl.config.resolution import local_paths_absolute
from grouprl.errors import UserError

#: Launch directives: what a command does, not what a run is. Never read from or written to a
#: run's config.yaml, so that a saved config is a record and can never resume or overwrite.
LAUNCH_FIELDS = ("config", "resume", "allow_change")
#: The key under which a run from Python records its live objects' identities.
LIVE_KEY = "live"
#: Fields a resumed run may change: how long, how often to evaluate and save, how much to log,
#: and where it runs. Anything else would make the rest of the run a different run.
RESUMABLE_FIELDS = (
    "steps", "eval_every", "eval_size", "eval_samples", "save_every", "keep_last",
    "log_samples", "log_ratios", "log_ratios_every", "log_groups", "log_groups_every", "doctor", "threads", "progress",
    "reward_timeout", "tool_timeout", "device", "strategy", "report_to", "run_name", "trl_metrics",
    "vllm_gpu_memory_utilization", "vllm_kv_cache_gb", "vllm_sleep", "vllm_enforce_eager",
    "vllm_mode", "sampler_threads", "vllm_server", "vllm_weights_dir",
)  # fmt: skip

Config = TypeVar("Config")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_plain_bool(annotation: Any) -> bool:
    return annotation is bool


def _text_kind(annotation: Any) -> type | None:
    """str, Path or list for fields that hold text (plain, Optional, or a list of strings)."""
    options = [a for a in typing.get_args(annotation) if a is not type(None)]
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    if union and len(options) != 1:
        return None
    base = options[0] if union else annotation
    if base in (str, Path):
        return base
    if typing.get_origin(base) is list and typing.get_args(base) == (str,):
        return list
    return None


def split_mapping(
    values: dict[str, Any], cls: type, *, source: str
) -> tuple[list[str], dict[str, Any]]:
    """What a YAML mapping says: command-line tokens for the parser, and the text fields as
    they are (see the module docstring).

    Text (strings, paths, lists of strings) needs no parsing, and as a token it could be taken
    for a flag (`stop: ["-x"]`) or for None (`"None"`); every other value becomes the flag that
    says the same thing, so the parser types and checks it. Unknown keys are errors with a
    suggestion; launch directives (`resume`, `config`) are ignored with a warning, so an earlier
    run's saved config can only ever start a new run.
    """
    known = field_names(cls)
    hints = _field_types(cls)
    args: list[str] = []
    text: dict[str, Any] = {}
    if LIVE_KEY in values:
        objects = ", ".join(str(k).removeprefix("live:") for k in values[LIVE_KEY] or {})
        raise UserError(
            f"{source} records a run made from Python with live objects ({objects}); the "
            "command line cannot give them: resume or repeat it from Python with "
            "grouprl.Trainer and the same objects"
        )
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name in LAUNCH_FIELDS:
            warnings.warn(
                f"{source}: '{key}' ignored: a config file only describes a run; pass --{name} "
                "on the command line",
                stacklevel=2,
            )
            continue
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(known)}"
            raise UserError(f"unknown config key {key!r} in {source}{hint}")
        flag = _flag(name)
        kind = _text_kind(hints[name])
        if kind is not None and value is not None:
            if kind is list:
                items = value if isinstance(value, (list, tuple)) else [value]
                if any(isinstance(v, (dict, list)) for v in items):
                    raise UserError(f"{key} in {source} takes a list of strings, got {value!r}")
                text[name] = [str(v) for v in items]  # [] stays []: none, not the default
            elif isinstance(value, (dict, list)):
                raise UserError(f"{key} in {source} takes a string, got {value!r}")
            else:
                text[name] = kind(str(value))
        elif _is_plain_bool(hints[name]):
            if not isinstance(value, bool):
                raise UserError(f"{key} in {source} must be true or false, got {value!r}")
            args.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            args.append(f"{flag}=None")
        elif isinstance(value, dict):
            args += [flag, *(str(t) for kv in value.items() for t in kv)]
        elif isinstance(value, (list, tuple)):
            args += [flag, *(str(v) for v in value)] if value else [f"{flag}=None"]
        else:
            args.append(f"{flag}={value}")
    return args, text


@functools.cache
def _hints(cls: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """`cls`'s type hints (read once: each read evaluates every annotation) and, for each
    field whose choices are a registry's, the function that lists them now."""
    hints = typing.get_type_hints(cls)
    factories = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        marks = typing.get_args(hint)[1:] if typing.get_origin(hint) is typing.Annotated else ()
        factory = next((m.constructor_factory for m in marks
                        if getattr(m, "constructor_factory", None) is not None), None)  # fmt: skip
        if factory is not None:
            factories[name] = factory
    return hints, factories


def _field_types(cls: type) -> dict[str, Any]:
    """Each field's type as the parser takes it: a registry's choices (`grouprl.config.choices`,
    read when tyro builds a parser) as the Literal of its names now."""
    hints, factories = _hints(cls)
    return {**hints, **{name: factory() for name, factory in factories.items()}}


def _expected(cls: type, name: str) -> str:
    """What a field takes, in words, for error messages."""
    annotation = _field_types(cls).get(name)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if len(args) == 1 else annotation
    origin = typing.get_origin(base)
    if base is int:
        return "an integer"
    if base is float:
        return "a number"
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(base)))
    if origin is tuple:
        return f"{len(typing.get_args(base))} numbers"
    if origin is dict:
        return "NAME VALUE pairs"
    if origin is list:
        return "one or more values"
    return "a value"


def _unknown(token: str, cls: type, where: str) -> UserError:
    """A token no field takes: a flag that does not exist (with the nearest one), or a value
    after a switch."""
    if token.startswith("--"):
        options = [_flag(n) for n in field_names(cls)]
        close = difflib.get_close_matches(token.split("=")[0], options, n=1)
        hint = f"; did you mean {close[0]}?" if close else "; see --help"
        return UserError(f"unknown flag {token}{where}{hint}")
    return UserError(f"unexpected value {token!r}{where}; a switch like --progress takes none")


def _is_flag(token: str) -> bool:
    return token.startswith("--") and not _is_number(token)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _flag_groups(args: Sequence[str]) -> list[list[str]]:
    """The tokens as [flag, values...] groups, `--flag=value` split; tokens before the first
    flag form a group of their own."""
    groups: list[list[str]] = []
    for token in args:
        if _is_flag(token):
            groups.append(token.split("=", 1))
        elif groups:
            groups[-1].append(token)
        else:
            groups.append([token])
    return groups


def _culprit(cls: type, args: Sequence[str], default: Any, source: str) -> UserError:
    """The one line for tokens tyro refused: the first flag whose values alone it refuses,
    naming the field, what it takes and where it came from."""
    where = f" in {source}" if source != "the command line" else ""
    group = next((g for g in _flag_groups(args) if _refuses(cls, g, default)), None)
    if group is None:
        return UserError(f"invalid arguments{where}; see --help")
    name = group[0][2:].replace("-", "_")
    name = name.removeprefix("no_") if name not in field_names(cls) else name
    if not group[0].startswith("--") or name not in field_names(cls):
        return _unknown(group[0], cls, where)
    label = name if source != "the command line" else _flag(name)
    expected = _expected(cls, name)
    if expected.startswith("one of") and len(group) == 2:
        return UserError(f"{label}{where}: {group[1]!r} is not {expected}")
    return UserError(f"{label}{where} takes {expected}")


def _refuses(cls: type, args: list[str], default: Any) -> bool:
    """Whether tyro refuses these tokens (its error box silenced: some of tyro's errors print
    whatever console_outputs says)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            tyro.cli(cls, args=args, default=default, console_outputs=False)
    except SystemExit:
        return True
    return False


def parse_args(
    cls: type[Config],
    args: Sequence[str],
    *,
    prog: str,
    source: str,
    text: dict[str, Any] | None = None,
) -> Config:
    """`cls` from command-line tokens with tyro, starting from the `text` fields of a file (see
    `split_mapping`); a bad value is one UserError line (`_culprit` finds which flag tyro
    refused by parsing each flag's tokens alone). `--help` prints the help and exits
    (SystemExit 0) as usual."""
    default = cls(**(text or {}))
    args = list(args)
    if "-h" in args or "--help" in args:
        return tyro.cli(cls, args=args, prog=prog, default=default)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            parsed, unknown = tyro.cli(cls, args=args, prog=prog, default=default,
                                       return_unknown_args=True, console_outputs=False)  # fmt: skip
    except SystemExit:
        raise _culprit(cls, args, default, source) from None
    if unknown:
        raise _unknown(unknown[0], cls, f" in {source}" if source != "the command line" else "")
    return parsed


def from_mapping(values: dict[str, Any], *, source: str, cls: type | None = None) -> Any:
    """A config from a YAML-like mapping, parsed as the flags that say the same thing."""
    cls = cls or TrainConfig
    args, text = split_mapping(values, cls, source=source)
    return parse_args(cls, args, prog="grouprl", source=source, text=text)


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a config file written by hand or saved by an earlier run."""
    if not path.is_file():
        raise UserError(f"config file {path} does not exist; check the path given to --config")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise UserError(f"config file {path} is not valid YAML{where}; fix its syntax") from None
    if not isinstance(values, dict):
        raise UserError(f"config file {path} must hold a mapping of field: value")
    return values


def config_record(cfg: TrainConfig) -> dict[str, Any]:
    """The config a run records, as plain values: every field but the launch directives and the
    output directory (copied as a template, it starts a new run in a new directory)."""
    skip = {*LAUNCH_FIELDS, "output_dir"}  # the record lives in its directory: no need to say
    values = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}
    for key, value in values.items():
        if isinstance(value, Path):
            values[key] = str(value)
        elif isinstance(value, tuple):
            values[key] = list(value)
    return values


def to_yaml(cfg: TrainConfig, *, live: dict[str, str] | None = None) -> str:
    """`config_record` as the YAML a run directory's config.yaml holds; a run from Python adds
    what identifies each live object it was given (`live:`, spec -> identity)."""
    record = config_record(cfg)
    if live:
        record[LIVE_KEY] = dict(live)
    return yaml.safe_dump(record, sort_keys=False)


def parse_train_args(argv: Sequence[str]) -> TrainConfig:
    """`grouprl train`'s config from its flags, a `--config` file, or the run to `--resume`.

    With `--resume RUN`, the run's saved config is the base and only RESUMABLE_FIELDS (and those
    named by `--allow-change`) may differ from it; `--config` and `--output-dir` are refused
    (the run's own directory and config are what continues).
    """
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        return parse_args(TrainConfig, argv, prog="grouprl train", source="the command line")
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for name in ("--config", "--resume", "--output-dir"):
        pre.add_argument(name)
    try:
        known, _ = pre.parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise UserError(f"{err}; see grouprl train --help") from None
    cli = "the command line"
    if known.resume is not None:
        for flag, value in (("--config", known.config), ("--output-dir", known.output_dir)):
            if value is not None:
                raise UserError(
                    f"--resume continues a run in its own directory with its own config; drop "
                    f"{flag} (to start a new run from its config: --config "
                    f"{Path(known.resume) / 'config.yaml'} --output-dir NEW)"
                )
        saved_path = Path(known.resume) / "config.yaml"
        if not saved_path.is_file():
            raise UserError(
                f"{known.resume} is not a run directory (no config.yaml); check --resume"
            )
        base, text = split_mapping(load_yaml(saved_path), TrainConfig, source=str(saved_path))
        saved = parse_args(
            TrainConfig, base, prog="grouprl train", source=str(saved_path), text=text
        )
        cfg = parse_args(TrainConfig, [*base, *argv], prog="grouprl train", source=cli, text=text)
        cfg = dataclasses.replace(cfg, output_dir=Path(known.resume))
        _check_resume_changes(saved, cfg)
        return cfg
    base, text = [], {}
    if known.config is not None:
        path = Path(known.config)
        base, text = split_mapping(load_yaml(path), TrainConfig, source=str(path))
        parse_args(TrainConfig, base, prog="grouprl train", source=str(path), text=text)
    return parse_args(TrainConfig, [*base, *argv], prog="grouprl train", source=cli, text=text)


def resume_config(run_dir: Path, changes: dict[str, Any]) -> tuple[TrainConfig, dict[str, str]]:
    """For resuming from Python: the run's saved config with `changes` (fields, as the flags
    of `--resume` may change them, and as strictly checked), and what identifies each live
    object it was given."""
    saved_path = Path(run_dir) / "config.yaml"
    if not saved_path.is_file():
        raise UserError(f"{run_dir} is not a run directory (no config.yaml); check resume=")
    values = load_yaml(saved_path)
    live = {str(k): str(v) for k, v in (values.pop(LIVE_KEY, None) or {}).items()}
    saved = from_mapping(values, source=str(saved_path))
    unknown = sorted(set(changes) - set(field_names()))
    if unknown:
        raise UserError(f"no option {unknown[0]!r}; see grouprl train --help for the options")
    cfg = dataclasses.replace(saved, **changes, resume=Path(run_dir), output_dir=Path(run_dir))
    _check_resume_changes(saved, cfg)
    return cfg, live


def _check_resume_changes(saved: TrainConfig, cfg: TrainConfig) -> None:
    allowed = {*RESUMABLE_FIELDS, *LAUNCH_FIELDS, "output_dir", *(cfg.allow_change or [])}
    unknown = sorted(set(cfg.allow_change or []) - set(field_names()))
    if unknown:
        raise UserError(f"--allow-change names no field {unknown[0]!r}; see --help for fields")
    saved, cfg = local_paths_absolute(saved), local_paths_absolute(cfg)  # as resolve() records
    for f in dataclasses.fields(TrainConfig):
        before, after = getattr(saved, f.name), getattr(cfg, f.name)
        if f.name not in allowed and before != after:
            raise UserError(
                f"--resume: {f.name} would change from {before!r} to {after!r}, which makes the "
                f"rest of the run a different run; resume may change {', '.join(RESUMABLE_FIELDS)} "
                f"(add --allow-change {f.name} if you mean it, or start a new run)"
            )
