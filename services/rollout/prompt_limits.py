"""Bounds on prompt text, checked before any tokenising, and tokenising kept off the
event loop for large prompts.

Both front doors (gRPC ``Generate`` and the OpenAI-compatible HTTP API) share one event
loop with the health service and every other call: a multi-megabyte prompt tokenised
on it stalled them all for seconds. So a prompt is measured in bytes first (cheap) and
refused past ``max_prompt_bytes``; one past :data:`INLINE_BYTES` is tokenised in a
worker thread (Hugging Face's fast tokenizers release the GIL while they encode, and
several threads may share one), so the loop keeps answering meanwhile.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Prompts up to this many bytes are tokenised inline (a few milliseconds at most): a
#: thread hand-off would cost about as much as the work.
INLINE_BYTES = 16 * 1024


def text_bytes(text: str) -> int:
    """UTF-8 length of ``text`` (what the tokenizer has to read)."""
    return len(text.encode("utf-8", errors="surrogatepass"))


def is_text(text: str) -> bool:
    """Whether UTF-8 can carry ``text``: JSON's ``\\ud800``-style escapes decode to lone
    surrogates, which no tokenizer, stop string or protobuf string field takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def too_long(size: int, limit: int) -> str:
    """Why a prompt of ``size`` bytes is refused under ``limit`` ('' when it is not)."""
    if size > limit:
        return f"prompt text is {size} bytes, more than this server tokenises (max_prompt_bytes={limit})"
    return ""


async def tokenize_off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` inline for a small prompt of ``size`` bytes, else in a worker thread."""
    if size <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
