"""Pipes of spawned processes are closed exactly once under uvloop (the services' loop),
and as soon as they end, not when the garbage collector finds them.

uvloop gives the descriptor to libuv, which closes it, and then closes the pipe's file
object, which closes the same number again (MagicStack/uvloop#763). In between, another
thread of the service (gRPC, ``to_thread`` workers) may have been given that number: a
later exec's pipe or pidfd is closed under it, and that exec never ends. Measured here:
11 descriptors of a busy thread closed under it in 500 spawns before the fix, 0 after."""
from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from services.envsandbox.sandbox import pump_process
from services.envsandbox.spawn import spawn

uvloop = pytest.importorskip("uvloop")


async def _spawn_many(n: int) -> None:
    for _ in range(n):
        proc = await spawn(["/bin/true"], env={})
        assert proc.stdout is not None and proc.stderr is not None and proc.stdin is not None
        await proc.stdout.read()
        await proc.stderr.read()
        await proc.wait()
        proc.stdin.close()
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)  # the last transports' closes run


def test_spawning_never_closes_another_threads_descriptors() -> None:
    stop = threading.Event()
    lost: list[int] = []

    def churn() -> None:
        # Another thread of the process, opening and closing descriptors all the time.
        while not stop.is_set():
            for r, w in [os.pipe() for _ in range(8)]:
                for fd in (r, w):
                    try:
                        os.fstat(fd)
                        os.close(fd)
                    except OSError:
                        lost.append(fd)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        # A pidfd closed under its exec makes the exec wait forever: fail instead of hanging.
        uvloop.run(asyncio.wait_for(_spawn_many(500), 60))
    finally:
        stop.set()
        thread.join()
    assert lost == [], f"{len(lost)} descriptors of another thread were closed by the spawner"


@pytest.mark.parametrize("run", [uvloop.run, asyncio.run], ids=["uvloop", "asyncio"])
def test_spawning_leaks_no_descriptors(run) -> None:  # type: ignore[no-untyped-def]
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    run(_spawn_many(50))
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before + 2


def _pipes_open() -> set[str]:
    """This process's open pipe descriptors, as 'number:pipe:[inode]'."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own descriptor, closed since
            continue
        if target.startswith("pipe:"):
            found.add(f"{fd}:{target}")
    return found


def _pipes_left(run: Callable[[Any], Any], work: Callable[[], Awaitable[None]]) -> set[str]:
    """The pipes ``work`` left open, run by ``run`` with the garbage collector off: only
    closing, not collection, may release them."""

    async def work_and_count() -> set[str]:
        before = _pipes_open()
        await work()
        return _pipes_open() - before

    gc.collect()
    gc.disable()
    try:
        return run(work_and_count())
    finally:
        gc.enable()


@pytest.mark.parametrize("run", [uvloop.run, asyncio.run], ids=["uvloop", "asyncio"])
def test_pipes_read_to_their_end_close_without_garbage_collection(run) -> None:  # type: ignore[no-untyped-def]
    """A finished command's pipes close when they are read to their end, not when the
    garbage collector next finds them: a busy service's descriptors would otherwise pile
    up between collections. uvloop keeps a read pipe open after its end when the
    protocol asks to (as asyncio's stream protocol does, for sockets' half close):
    before the fix all 400 stdout and stderr pipes of these 200 spawns were left open
    under uvloop (about 50 with the collector on)."""
    left = _pipes_left(run, lambda: _spawn_many(200))
    # Two spare, as the tests above allow: a pipe some other thread of the run opened meanwhile.
    assert len(left) <= 2, f"{len(left)} pipes still open after their commands ended: {sorted(left)[:6]}"


async def _pump_cut_off(n: int) -> None:
    """Commands whose output the sandbox's pump cuts off: one past its wall time that
    never reads its stdin, one flooding stdout past the output limit."""

    async def pumped(argv: list[str], stdin: bytes) -> None:
        proc = await spawn(argv, env={})
        async for _ in pump_process(proc, stdin, 0.1, 1000, proc.kill):
            pass
        await proc.wait()

    for _ in range(n):
        await pumped(["/bin/sleep", "5"], b"x" * (1 << 20))
        await pumped(["/usr/bin/yes"], b"")
    await asyncio.sleep(0.2)  # the killed commands' pipes reach their end


@pytest.mark.parametrize("run", [uvloop.run, asyncio.run], ids=["uvloop", "asyncio"])
def test_pipes_of_commands_cut_off_close_without_garbage_collection(run) -> None:  # type: ignore[no-untyped-def]
    """The same for commands the pump cuts off (wall time, output limit): their pipes
    reach their end once the pump kills them, and close then (40 left before the fix)."""
    left = _pipes_left(run, lambda: _pump_cut_off(10))
    assert len(left) <= 2, f"{len(left)} pipes still open after their commands were cut off: {sorted(left)[:6]}"


async def _spawn_cancelled_at_every_step() -> tuple[int, list[object]]:
    """Spawns cancelled after 0, 1, 2, ... loop iterations (so at each of spawn's waits):
    how many were cancelled, and the errors the loop was handed."""
    errors: list[object] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx.get("exception") or ctx.get("message")))
    cancelled = 0
    for steps in range(12):
        task = asyncio.ensure_future(spawn(["/bin/sleep", "5"], env={}))
        for _ in range(steps):
            await asyncio.sleep(0)
        cancelled += task.cancel()
        try:
            proc = await task
        except asyncio.CancelledError:
            continue
        proc.kill()
        await proc.wait()
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        await proc.stdout.read()
        await proc.stderr.read()
        proc.stdin.close()
    await asyncio.sleep(0.2)  # the cancelled connects' transports close
    return cancelled, errors


@pytest.mark.parametrize("run", [uvloop.run, asyncio.run], ids=["uvloop", "asyncio"])
def test_a_spawn_cancelled_anywhere_closes_each_pipe_once(run) -> None:  # type: ignore[no-untyped-def]
    """A spawn cancelled while a pipe's transport is being made (a caller whose client went
    away): that transport closes its pipe a moment later, so the spawn's cleanup must not
    close the same number first. Before the fix asyncio's loop logged six EBADF here: the
    transport's close came second, and could have closed whatever took the number."""
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    cancelled, errors = run(_spawn_cancelled_at_every_step())
    gc.collect()
    assert cancelled > 3, "the spawns were not cut off at their waits"
    assert errors == []
    assert len(os.listdir("/proc/self/fd")) <= before + 2
