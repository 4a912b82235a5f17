"""Which folders meridian.model_store takes for a model, and where it caches; the
models themselves are built in the engine and trainer tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from meridian import model_store


def _model_folder(path: Path, weights: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


def test_a_folder_without_weights_is_not_a_model(tmp_path: Path) -> None:
    """A copy cut short (config.json there, the safetensors not yet) must be refused
    with its name, not handed to an engine that fails later with a loader's traceback."""
    half = _model_folder(tmp_path / "half", weights=False)
    with pytest.raises(FileNotFoundError, match="half"):
        model_store.resolve_model(str(half))
    whole = _model_folder(tmp_path / "whole")
    assert model_store.resolve_model(str(whole)) == whole


def test_a_model_path_may_start_with_a_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    model = _model_folder(tmp_path / "models" / "m")
    assert model_store.resolve_model("~/models/m") == model


def test_the_cache_follows_meridian_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers and CI point the cache at a volume: the built-in model's conversion
    must land there, not in a home directory that goes away."""
    monkeypatch.setenv("MERIDIAN_CACHE_DIR", str(tmp_path / "cache"))
    assert model_store.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("MERIDIAN_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_store.cache_dir() == tmp_path / "home" / ".cache" / "meridian"
