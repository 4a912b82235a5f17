"""Fixtures for tests that run the real stack: a tiny model and an OTLP receiver."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.otlp_receiver import OtlpReceiver


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A tiny random Llama with the built-in tokenizer, cached across runs."""
    from meridian.model_store import cache_dir, make_tiny_model

    return make_tiny_model(cache_dir() / "models" / "tiny-llama-test")


@pytest.fixture(scope="session")
def otlp() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver
