"""Steps that must not stop halfway when the call waiting on them is cancelled.

A gRPC handler is cancelled when its client goes away (a deadline, a dropped
connection). Most work may stop there; some may not: a teardown cut short leaves
processes, mounts or a uid behind while the count says they are free, a test run cut
short leaves hidden tests on a sandbox's disk, and a version stored but never announced
leaves every subscriber waiting. :class:`RunToEnd`
runs such a step as a task of its own, lets the caller stop waiting at once, and keeps
the task (the event loop holds only weak references) until it ends.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


class RunToEnd:
    """The steps started by :meth:`run` that are still running, for one owner; ``what``
    names them in the log line of a step whose caller left before it failed."""

    def __init__(self, what: str, log: logging.Logger) -> None:
        self.what = what
        self._log = log
        self._running: set[asyncio.Future[Any]] = set()

    async def run(self, step: Coroutine[Any, Any, _T], started: Callable[[asyncio.Future[_T]], object] | None = None) -> _T:
        """Runs ``step`` to its end and returns its result; a caller cancelled meanwhile
        gets its cancellation at once while the step runs on. ``started`` is called with
        the step's task before the first wait (to tie something else to its end)."""
        task = asyncio.ensure_future(step)
        self._running.add(task)
        task.add_done_callback(self._ended)
        if started is not None:
            started(task)
        return await asyncio.shield(task)

    def _ended(self, task: asyncio.Future[Any]) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # A caller still waiting got the error; this keeps it from going unretrieved.
            self._log.debug("%s failed: %s", self.what, task.exception())

    async def wait(self) -> None:
        """Returns once every step started so far has ended (their errors are the callers')."""
        pending: list[Awaitable[Any]] = list(self._running)
        await asyncio.gather(*pending, return_exceptions=True)
