"""Traffic classes come from the caller's key, not from anything else it sends."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from meridian.errors import Unauthenticated
from services.rollout.callers import CallerClasses
from services.rollout.engine import PRIORITY_PRODUCTION, PRIORITY_RL


def test_each_key_gets_its_configured_class(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"front-end": "production", "batch": "rl"}))
    callers = CallerClasses.load(str(path), "rl")
    assert callers.classify("Bearer front-end") == PRIORITY_PRODUCTION
    assert callers.classify("bearer batch") == PRIORITY_RL
    assert callers.classify(None) == PRIORITY_RL  # anonymous callers: the configured class


@pytest.mark.parametrize("header", ["Bearer nope", "Basic front-end", "Bearer ", "front-end"])
def test_unknown_or_malformed_keys_are_refused_without_echoing_them(header: str) -> None:
    callers = CallerClasses({"front-end": "production"})
    with pytest.raises(Unauthenticated) as info:
        callers.classify(header)
    assert "nope" not in str(info.value)


def test_anonymous_callers_can_be_denied() -> None:
    with pytest.raises(Unauthenticated, match="needs an API key"):
        CallerClasses({}, "deny").classify("")


def test_without_a_key_file_every_caller_is_anonymous() -> None:
    assert CallerClasses({}, "rl").classify("Bearer unused") == PRIORITY_RL


@pytest.mark.parametrize("content", ['{"k": "urgent"}', "[1]", "{", '{"": "rl"}'])
def test_bad_key_files_are_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="caller classes"):
        CallerClasses.load(str(path), "production")
