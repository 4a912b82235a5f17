"""Random and mutated protobuf requests for fuzzing a gRPC service (tests only).

Every service must answer bad input with a clear status (INVALID_ARGUMENT, NOT_FOUND, ...)
and go on serving; an unhandled exception reaches the client as INTERNAL (the error
boundary) or UNKNOWN, and a stalled handler as DEADLINE_EXCEEDED. :class:`Fuzzer` makes
the inputs from the message descriptors alone, seeded, so a failure names the seed and
the request that caused it: whole random messages, and valid requests with a few fields
changed (which get past the first check and reach the code behind it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf import text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from meridian.grpc_runtime import ended_while_sending

#: Codes that mean the service did not handle the request: an exception escaped its
#: handler (the error boundary's INTERNAL, or UNKNOWN). A crash or a stall shows in the
#: liveness probe the tests make after every request.
UNHANDLED = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})

_INT32 = (0, 1, -1, 2, 3, 7, 64, 1000, 2**31 - 1, -(2**31))
_INT64 = (*_INT32, 2**40, 2**63 - 1, -(2**63))
_UINT32 = (0, 1, 2, 3, 7, 64, 1000, 2**32 - 1)
_UINT64 = (*_UINT32, 2**40, 2**64 - 1)
_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-30, 1e30, 3.4e38, math.nan, math.inf, -math.inf)
_STRINGS = ("", "x", "0", "-1", " ", "../../etc/passwd", "/", "/etc/shadow", ".", "a/../../b", "é漢字🙂", "\x00", "a\nb", "%s%n", "x" * 5000)
_BYTES = (b"", b"\x00", b"\xff" * 16, bytes(range(256)))

_INTS = {
    FieldDescriptor.TYPE_INT32: _INT32, FieldDescriptor.TYPE_SINT32: _INT32, FieldDescriptor.TYPE_SFIXED32: _INT32,
    FieldDescriptor.TYPE_INT64: _INT64, FieldDescriptor.TYPE_SINT64: _INT64, FieldDescriptor.TYPE_SFIXED64: _INT64,
    FieldDescriptor.TYPE_UINT32: _UINT32, FieldDescriptor.TYPE_FIXED32: _UINT32,
    FieldDescriptor.TYPE_UINT64: _UINT64, FieldDescriptor.TYPE_FIXED64: _UINT64,
}


class Fuzzer:
    """Seeded request maker. ``hints`` maps a field name to values that are plausible for
    it (a live sandbox's id, a task's id): used half the time, so requests reach past the
    lookups; the other half is drawn from each type's edge cases."""

    def __init__(self, seed: int, hints: Mapping[str, Sequence[Any]] | None = None, max_depth: int = 3) -> None:
        self.rng = random.Random(seed)
        self.hints = dict(hints or {})
        self.max_depth = max_depth

    def message(self, cls: type[Message]) -> Message:
        """A message of ``cls`` with random fields set."""
        msg = cls()
        self._fill(msg, 0)
        return msg

    def mutate(self, valid: Message, changes: int = 2) -> Message:
        """A copy of ``valid`` with ``changes`` fields somewhere in it set anew or cleared."""
        msg = type(valid)()
        msg.CopyFrom(valid)
        for _ in range(changes):
            self._change_one(msg, 0)
        return msg

    # ------------------------------------------------------------ values

    def _scalar(self, field: FieldDescriptor) -> Any:
        rng = self.rng
        hinted = self.hints.get(field.name)
        if hinted and rng.random() < 0.5:
            return rng.choice(list(hinted))
        t = field.type
        if t in _INTS:
            pool = _INTS[t]
            return rng.choice(pool) if rng.random() < 0.7 else rng.randint(min(pool), max(pool))
        if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return rng.choice(_FLOATS) if rng.random() < 0.7 else rng.uniform(-1e3, 1e3)
        if t == FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if t == FieldDescriptor.TYPE_STRING:
            if rng.random() < 0.7:
                return rng.choice(_STRINGS)
            return "".join(chr(rng.choice((rng.randint(32, 126), rng.randint(0xA0, 0xD7FF)))) for _ in range(rng.randint(1, 40)))
        if t == FieldDescriptor.TYPE_BYTES:
            return rng.choice(_BYTES) if rng.random() < 0.6 else rng.randbytes(rng.randint(1, 300))
        if t == FieldDescriptor.TYPE_ENUM:
            return rng.choice([v.number for v in field.enum_type.values] + [-1, 99])
        raise TypeError(f"no values for field {field.full_name} of type {t}")

    # ------------------------------------------------------------ setting

    def _fill(self, msg: Message, depth: int) -> None:
        for field in msg.DESCRIPTOR.fields:
            if self.rng.random() < 0.4:
                continue
            self._set(msg, field, depth)

    def _set(self, msg: Message, field: FieldDescriptor, depth: int) -> None:
        rng = self.rng
        is_message = field.type == FieldDescriptor.TYPE_MESSAGE
        if is_message and field.message_type.GetOptions().map_entry:
            self._set_map(getattr(msg, field.name), field, depth)
        elif field.is_repeated:
            values = getattr(msg, field.name)
            del values[:]
            for _ in range(rng.choice((0, 1, 1, 2, 3, 40))):
                if is_message:
                    if depth < self.max_depth:
                        self._fill(values.add(), depth + 1)
                else:
                    _try(lambda: values.append(self._scalar(field)))
        elif is_message:
            sub = getattr(msg, field.name)
            sub.SetInParent()
            if depth < self.max_depth:
                self._fill(sub, depth + 1)
        else:
            _try(lambda: setattr(msg, field.name, self._scalar(field)))

    def _set_map(self, mapping: Any, field: FieldDescriptor, depth: int) -> None:
        key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        mapping.clear()
        for _ in range(self.rng.choice((0, 1, 2, 3))):
            key = self._scalar(key_field)
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                if depth < self.max_depth:
                    self._fill(mapping[key], depth + 1)
            else:
                _try(lambda key=key: mapping.__setitem__(key, self._scalar(value_field)))

    def _change_one(self, msg: Message, depth: int) -> None:
        fields = list(msg.DESCRIPTOR.fields)
        if not fields:
            return
        field = self.rng.choice(fields)
        set_here = [f for f, _ in msg.ListFields()]
        # Into a set sub-message half the time, so deep fields change too.
        if (
            field in set_here and field.type == FieldDescriptor.TYPE_MESSAGE and depth < self.max_depth and self.rng.random() < 0.5
            and not field.message_type.GetOptions().map_entry
        ):
            value = getattr(msg, field.name)
            inner = (self.rng.choice(list(value)) if len(value) else None) if field.is_repeated else value
            if inner is not None:
                self._change_one(inner, depth + 1)
                return
        if self.rng.random() < 0.2:
            msg.ClearField(field.name)
        else:
            self._set(msg, field, depth)


def requests_for(valid: Message, count: int, hints: Mapping[str, Sequence[Any]] | None = None) -> list[tuple[int, Message]]:
    """``count`` seeded requests of ``valid``'s type: even seeds whole random messages,
    odd ones ``valid`` with one to three fields changed."""
    out = []
    for seed in range(count):
        fuzzer = Fuzzer(seed=seed, hints=hints)
        out.append((seed, fuzzer.mutate(valid, changes=1 + seed % 3) if seed % 2 else fuzzer.message(type(valid))))
    return out


def _try(set_value: Any) -> None:
    """Sets a value, skipping one protobuf refuses (a float beyond float32, say)."""
    try:
        set_value()
    except (ValueError, TypeError, OverflowError):
        pass


@dataclasses.dataclass
class Finding:
    """A request a service did not handle: what was sent and what came back."""

    method: str
    seed: int
    request: str
    code: grpc.StatusCode
    details: str

    def __str__(self) -> str:
        return f"{self.method} (seed {self.seed}) -> {self.code.name}: {self.details[:300]}\n    request: {self.request[:600]}"


def shown(request: Message | Sequence[Message]) -> str:
    """One line of text for a request (or a request stream)."""
    if isinstance(request, Message):
        return text_format.MessageToString(request, as_one_line=True)
    return " | ".join(text_format.MessageToString(r, as_one_line=True) for r in request)


async def _drained(call: Any) -> Any:
    """The result of a unary call, or every message of a server stream."""
    if hasattr(call, "__aiter__"):
        return [m async for m in call]
    return await call


async def fuzz(
    name: str, call: Callable[[Any], Any], requests: list[tuple[int, Any]], probe: Callable[[], Awaitable[None]], findings: list[Finding],
    stalls_allowed: bool = False, probe_timeout_s: float = 10.0,
) -> None:
    """Sends each ``(seed, request)`` through ``call``; records in ``findings`` each answer the
    service did not handle (see :data:`UNHANDLED`) and each stall (DEADLINE_EXCEEDED, unless
    ``stalls_allowed``), and stops at the first request after which ``probe`` fails."""
    for seed, request in requests:
        try:
            await _drained(call(request))
        except grpc.aio.AioRpcError as exc:
            stalled = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not stalls_allowed
            if (exc.code() in UNHANDLED and not ended_while_sending(exc)) or stalled:
                findings.append(Finding(name, seed, shown(request), exc.code(), exc.details() or ""))
        try:
            await asyncio.wait_for(probe(), probe_timeout_s)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the service stopped answering
            findings.append(Finding(name, seed, shown(request), grpc.StatusCode.UNAVAILABLE, f"the service stopped answering after it: {exc!r}"))
            return


def report(findings: list[Finding]) -> str:
    """The assertion message for ``findings``."""
    return f"{len(findings)} request(s) not handled:\n" + "\n".join(str(f) for f in findings[:12])
