"""One way to configure every process: dataclass fields become ``--flags`` whose
defaults come from ``MERIDIAN_<SECTION>_<FIELD>`` environment variables, then from
the field's documented default.

A field documents itself with ``field(default=..., metadata={"help": "..."})``; the
help text, the environment variable and the default all appear in ``--help``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, TypeVar

T = TypeVar("T")

_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off", ""}


def env_name(section: str, field_name: str) -> str:
    """The environment variable that sets ``field_name`` of ``section``."""
    return f"MERIDIAN_{section}_{field_name}".upper().replace("-", "_")


def parse_bool(text: str) -> bool:
    """Parses a flag or environment value as a boolean, rejecting anything ambiguous."""
    lowered = text.strip().lower()
    if lowered in _BOOL_TRUE:
        return True
    if lowered in _BOOL_FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false)")


def _converter(annotation: Any) -> Any:
    if annotation is bool:
        return parse_bool
    if annotation in (int, float, str):
        return annotation
    raise TypeError(f"unsupported config field type {annotation!r}")


def add_config_args(parser: argparse.ArgumentParser, cls: type, section: str) -> None:
    """Adds one ``--flag`` per field of dataclass ``cls`` to ``parser``."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{section} ({cls.__name__})")
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        convert = _converter(hints[f.name])
        env = env_name(section, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        raw = os.environ.get(env)
        if raw is not None:
            try:
                default = convert(raw)
            except ValueError as exc:
                raise SystemExit(f"invalid {env}={raw!r}: {exc}") from exc
        help_text = f.metadata.get("help", "")
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f"{section}__{f.name}",
            type=convert,
            default=default,
            metavar=hints[f.name].__name__.upper(),
            help=f"{help_text} [env {env}; default: {default!r}]",
        )


def config_from_args(cls: type[T], namespace: argparse.Namespace, section: str) -> T:
    """Builds ``cls`` from the parsed flags of ``section`` (its ``__post_init__`` validates)."""
    values = {
        f.name: getattr(namespace, f"{section}__{f.name}")
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init
    }
    return cls(**values)


def parse_config(cls: type[T], section: str, argv: list[str] | None = None) -> T:
    """Parses ``argv`` (flags only) into ``cls``; convenient for tests and sub-entrypoints."""
    parser = argparse.ArgumentParser()
    add_config_args(parser, cls, section)
    return config_from_args(cls, parser.parse_args(argv or []), section)


def opt(default: Any, help: str) -> Any:  # noqa: A002 - mirrors argparse's name
    """Shorthand for a documented dataclass field."""
    return dataclasses.field(default=default, metadata={"help": help})
