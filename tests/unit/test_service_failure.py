"""A rollout whose weight update fails part-way: a trial that cannot run is rolled back
and the gate reopens; an update that cannot be undone stops the follower, and a service
whose ``failure`` returns stops SERVING and exits 1 (for its supervisor to restart it)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from typing import Any

import numpy as np
import pytest

from meridian import grpc_runtime
from meridian.tensors import RawTensor
from meridian.v1 import weightsync_pb2 as wpb
from services.rollout.weight_changes import ChangeSet
from services.rollout.weight_updates import WeightUpdater

WEIGHTS = {"w": RawTensor("bf16", (4,), np.arange(4, dtype=np.uint16))}
NEW = {"w": RawTensor("bf16", (4,), np.arange(4, dtype=np.uint16) + 1)}


class FakeLLM:
    """The engine client calls an update makes, recorded; ``fail`` names the ones that raise."""

    def __init__(self, fail: set[str]) -> None:
        self.fail = fail
        self.calls: list[str] = []

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append(method)
        if method in self.fail:
            raise RuntimeError(f"{method} failed")
        return [0]

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append("reset_prefix_cache")
        return "reset_prefix_cache" not in self.fail


class FakeEngine:
    """What :class:`WeightUpdater` uses of the engine, on the full path."""

    def __init__(self, fail: set[str]) -> None:
        self.llm = FakeLLM(fail)
        self.version = 0
        self.update_lock = asyncio.Lock()
        self.gate_open = True
        self.settled: list[tuple[int, bool]] = []

    def close_gate(self) -> None:
        self.gate_open = False

    def open_gate(self) -> None:
        self.gate_open = True

    async def pause(self) -> None: ...

    async def freeze(self) -> None: ...

    async def resume(self) -> None: ...

    async def label_trial(self, version: int) -> None: ...

    async def settle_trial(self, version: int, accepted: bool) -> None:
        self.settled.append((version, accepted))
        if accepted:
            self.version = version

    async def score_now(self, token_ids: list[int]) -> list[float]:
        if "score_now" in self.llm.fail:
            raise RuntimeError("the engine died while scoring")
        return [0.0] * len(token_ids)


def _update(engine: FakeEngine) -> Any:
    updater = WeightUpdater(engine, "full")  # type: ignore[arg-type]
    canary = wpb.Canary(sequences=[wpb.CanarySequence(token_ids=[1, 2, 3], logprobs=[0.0, 0.0, 0.0])])
    return updater.update(ChangeSet.whole(NEW, 1, 0), NEW, canary, lambda: WEIGHTS)


def test_a_trial_that_cannot_run_is_rolled_back_and_the_gate_reopens() -> None:
    engine = FakeEngine({"score_now"})
    report = asyncio.run(_update(engine))
    assert not report.accepted and "trying the version in the engine failed" in report.error and "scoring" in report.error
    assert engine.gate_open and engine.version == 0 and engine.settled == [(1, False)]
    # The version went in, then the served one back.
    assert engine.llm.calls.count("meridian_full_reload") == 2


def test_an_update_that_cannot_be_undone_raises_with_the_gate_closed() -> None:
    engine = FakeEngine({"reset_prefix_cache"})  # the trial fails, and so does the roll-back
    with pytest.raises(RuntimeError, match="could not drop its KV cache"):
        asyncio.run(_update(engine))
    assert not engine.gate_open and engine.version == 0


def test_a_full_roll_back_never_reloads_a_version_the_follower_cannot_rebuild() -> None:
    """After the follower dropped its held weights (a version it could not decode: it asks
    for a keyframe), the served version can no longer be rebuilt from them. Should that
    keyframe be rejected on the full path, reloading the "served version" would load no
    tensor at all -- vLLM only warns -- and the engine would go on computing with the
    rejected weights under the old label. The roll-back must fail instead: the update
    raises with the gate closed, and the service stops."""
    from services.rollout.weight_follower import served_version
    from services.weightsync.receiver import Decoder
    from services.weightsync.versions import encode_version

    decoder = Decoder({}, -1, in_place=True)  # what the follower holds after a reset
    enc = encode_version(5, NEW, None, -1, 64)
    decoder.begin(enc.manifest)
    for i, chunk in enumerate(enc.chunks):
        decoder.add_chunk(i, chunk)
    decoder.finish()
    pending = [decoder.last_undo]
    engine = FakeEngine({"score_now"})  # the trial fails: the keyframe is rejected
    updater = WeightUpdater(engine, "full")  # type: ignore[arg-type]
    canary = wpb.Canary(sequences=[wpb.CanarySequence(token_ids=[1, 2, 3], logprobs=[0.0, 0.0, 0.0])])
    changes = ChangeSet.from_undos(decoder.weights, pending)
    with pytest.raises(RuntimeError, match="cannot be rebuilt"):
        asyncio.run(updater.update(changes, decoder.weights, canary, lambda: served_version(decoder.weights, pending)))
    assert not engine.gate_open and engine.llm.calls.count("meridian_full_reload") == 1


class _FailsAfterServing:
    """Serves, then its ``failure`` says why it cannot any longer."""

    service_names: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.stopped = False

    def register(self, server: object) -> None:
        pass

    async def start(self) -> None:
        pass

    async def failure(self) -> str:
        await asyncio.sleep(0.2)
        return "the weight follower stopped: RuntimeError: revert failed"

    async def stop(self) -> None:
        self.stopped = True


def test_a_service_that_fails_after_serving_stops_and_exits_1(caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    service = _FailsAfterServing()
    config = grpc_runtime.ServerConfig(host="127.0.0.1", port=0, insecure=True, grace_s=0.1)
    # Should the server not act on the failure, a SIGTERM ends it without exit 1: the
    # test then fails instead of hanging.
    fallback = threading.Timer(30, os.kill, (os.getpid(), signal.SIGTERM))
    fallback.start()
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as info:
            asyncio.run(grpc_runtime.run_server("rollout", service, config))
    finally:
        fallback.cancel()
    assert info.value.code == 1 and service.stopped
    printed = capsys.readouterr().out
    assert "meridian rollout serving" in printed
    assert "meridian rollout failed: the weight follower stopped: RuntimeError: revert failed" in printed


class _Upstream:
    """A stand-in for a relay's WeightSubscriber whose stream raises the next of ``errors``."""

    errors: list[BaseException] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def updates(self, follow: bool, keep_encoded: bool = False) -> Any:
        raise _Upstream.errors.pop(0)
        yield  # an async generator, as the real one

    async def close(self) -> None:
        pass


def test_a_relay_retries_what_upstream_sent_wrong_and_fails_on_what_it_cannot_recover_from(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from meridian.errors import InvalidArgument
    from services.weightsync import server
    from services.weightsync.config import WeightSyncConfig

    monkeypatch.setattr(server, "WeightSubscriber", _Upstream)
    _Upstream.errors = [InvalidArgument("tensor w: unknown dtype 99"), OSError(28, "No space left on device")]

    async def main() -> str:
        relay = server.WeightSyncService(WeightSyncConfig(data_dir=str(tmp_path), role="relay", upstream="127.0.0.1:1"))
        await relay.start()
        try:
            return await asyncio.wait_for(relay.failure(), 30)
        finally:
            await relay.stop()

    reason = asyncio.run(main())
    assert _Upstream.errors == []  # the refused stream was retried
    assert "upstream mirror stopped" in reason and "No space left on device" in reason


def test_the_follower_retries_a_refused_stream_and_stops_when_an_update_cannot_be_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from meridian.errors import InvalidArgument
    from services.rollout import weight_follower

    stream: list[Any] = [InvalidArgument("tensor w: unknown dtype 99"), "version 1"]

    class Subscriber:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        async def updates(self, follow: bool) -> Any:
            item = stream.pop(0)
            if isinstance(item, BaseException):
                raise item
            yield SimpleNamespace(weights=NEW, version=1, undo=object(), manifest=wpb.Manifest(version=1))

        async def close(self) -> None:
            pass

    class Updater:
        engine = SimpleNamespace(version=0)

        async def update(self, *args: Any) -> Any:
            raise RuntimeError("revert failed")

    monkeypatch.setattr(weight_follower.weightsync, "WeightSubscriber", Subscriber)
    monkeypatch.setattr(weight_follower.ChangeSet, "from_undos", classmethod(lambda cls, weights, pending: ChangeSet.whole(weights, 1, 0)))
    follower = weight_follower.WeightFollower("127.0.0.1:1", Updater(), WEIGHTS, "")  # type: ignore[arg-type]
    with pytest.raises(weight_follower.EngineStateUnknown, match="version 1 was neither applied nor rolled back: RuntimeError: revert failed"):
        asyncio.run(asyncio.wait_for(follower.run(), 30))
    assert stream == []  # the refused stream was retried
