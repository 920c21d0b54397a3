"""The spec toolbox: TOML reading, ``--set`` parsing, dataclass building and value checks (pure).

Shared by :mod:`cyclone_kit.config.profile` and :mod:`cyclone_kit.config.job`; every failure is a
one-line :class:`~cyclone_kit.core.errors.ValidationError` with a hint.
"""

from __future__ import annotations

import dataclasses
import datetime
import types
import typing
from pathlib import Path
from typing import Any

import tomllib

from cyclone_kit.core.errors import ValidationError, did_you_mean


def reject_empty_strings(data: Any, source: str, where: str = "") -> None:
    """Refuse an empty (or blank) string anywhere in a user's spec file: leave a key out instead.

    An empty value is what an unset shell variable or a half-edited file gives; taking it as "not
    given" would silently submit something else than asked (e.g. the default partition).
    """
    if isinstance(data, dict):
        for key, value in data.items():
            reject_empty_strings(value, source, f"{where}.{key}" if where else str(key))
    elif isinstance(data, list | tuple):
        for value in data:
            reject_empty_strings(value, source, where)
    elif isinstance(data, str) and not data.strip():
        raise ValidationError(
            f"{where} is empty in {source}",
            hint=f"remove the {where.rsplit('.', 1)[-1]} line to use the default, or give it a value",
        )


def parse_assignment(item: str) -> tuple[str, Any]:
    """Split ``key=value`` and parse the value as a TOML literal (else keep the string)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValidationError(f"--set {item!r} is not key=value", hint="write --set train.lr=0.2")
    if not raw.strip() or raw.strip() in ('""', "''"):
        raise ValidationError(
            f"--set {key}= has an empty value (an unset shell variable?)",
            hint=f"give {key} a value, or leave the --set out to keep the spec's",
        )
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if isinstance(value, datetime.date | datetime.time):
        value = raw.strip()  # 01:00:00 is a wall time, not a TOML time of day
    return key, value


def read_toml(path: Path) -> dict[str, Any]:
    """Read a TOML file, turning every failure into a one-line ValidationError."""
    text = read_text(path)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValidationError(f"{path}: malformed TOML ({e})", hint="fix the syntax at the position shown") from None


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValidationError(f"file {str(path)!r} does not exist", hint="check the path") from None
    except IsADirectoryError:
        raise ValidationError(f"{str(path)!r} is a directory, not a file", hint="give the path of a .toml file") from None
    except PermissionError:
        raise ValidationError(f"cannot read {str(path)!r}: permission denied", hint="check the file's permissions") from None
    except UnicodeDecodeError:
        raise ValidationError(f"{str(path)!r} is not UTF-8 text", hint="save the file as UTF-8") from None


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def build(cls: type, where: str, data: dict[str, Any]) -> Any:
    """Construct a frozen dataclass from a dict, checking unknown keys and value types."""
    names = field_names(cls)
    unknown = set(data) - set(names)
    if unknown:
        valid = [n for n in names if not (where == "partitions" and n == "name")]
        raise ValidationError(
            f"unknown key(s) in [{where}]: {', '.join(sorted(unknown))}",
            hint=did_you_mean(sorted(unknown), valid) + f"valid keys: {', '.join(valid)}",
        )
    hints = typing.get_type_hints(cls)
    kwargs = {k: coerce(f"{where}.{k}", hints[k], v) for k, v in data.items()}
    return cls(**kwargs)


def coerce(where: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return coerce(where, args[0], value)
    if origin is tuple:
        if isinstance(value, list | tuple):
            item = typing.get_args(hint)[0]
            if item is str and all(isinstance(v, str) for v in value):
                return tuple(value)
            if item is not str:
                return tuple(value)
        raise ValidationError(f"{where} must be a list of strings, got {value!r}", hint=f'write {where.split(".")[-1]} = ["..."]')
    if hint is str and isinstance(value, datetime.time):
        value = value.isoformat()  # an unquoted `time = 01:00:00` in TOML
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(hint, True)
    if not ok:
        example = {bool: "true", int: "4", float: "0.1", str: '"text"'}.get(hint, "")
        raise ValidationError(
            f"{where} must be {getattr(hint, '__name__', hint)}, got {type(value).__name__} {value!r}",
            hint=f"e.g. {where.split('.')[-1]} = {example}",
        )
    return float(value) if hint is float else value


def check_positive(where: str, value: int) -> None:
    if value < 1:
        raise ValidationError(f"{where} must be at least 1, got {value}", hint=f"set {where} to a positive count")


def check_non_negative(where: str, value: int) -> None:
    if value < 0:
        raise ValidationError(f"{where} must not be negative, got {value}", hint=f"set {where} to 0 or more")


def check_choice(where: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValidationError(f"unknown {where} {value!r}", hint=f"use one of: {', '.join(valid)}")


def check_directives(where: str, directives: tuple[str, ...]) -> None:
    for directive in directives:
        if not directive.startswith("--") or not directive.isprintable():
            raise ValidationError(
                f"{where} entry {directive!r} is not one '--option=value'",
                hint="write each extra #SBATCH directive as '--option=value' on one line",
            )


def check_safe_token(where: str, value: str) -> None:
    if value and not all(c.isascii() and (c.isalnum() or c in "._+-:") for c in value):
        raise ValidationError(
            f"{where} {value!r} contains characters Slurm does not accept here",
            hint="use ASCII letters, digits, '.', '_', '+', '-' or ':'",
        )
