"""envsandbox's live sandbox limit shared by several clients, over a real in-process
server (process backend): a Create that reserves room for its forks keeps it from other
clients until it forks, a Create that may wait takes its place in one line and gets in
as room comes back, in order, and a wait that ends (its time, its caller gone) gives
everything back. A sandbox being torn down still counts. Throughout, the slots held are
the live sandboxes plus the room reserved, and no more than the limit."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from meridian.v1 import envsandbox_pb2 as es
from meridian.v1 import envsandbox_pb2_grpc as es_grpc
from services.envsandbox.config import EnvSandboxConfig
from services.envsandbox.server import EnvSandboxService
from tests.unit.test_grpc_services import expect_code, run

Serving = Callable[..., Any]


def _service(tmp_path: Path, max_sandboxes: int, max_create_wait_s: float = 600.0) -> EnvSandboxService:
    return EnvSandboxService(EnvSandboxConfig(root=str(tmp_path / "sandboxes"), max_sandboxes=max_sandboxes, max_create_wait_s=max_create_wait_s))


def _accounted(service: EnvSandboxService) -> tuple[int, int, int]:
    """(slots held, live sandboxes, slots reserved); the first must be the sum of the others."""
    boxes = service.sandboxes
    held, live, reserved = boxes.slots.held, len(boxes.list()), boxes.reserved
    assert held == live + reserved <= boxes.max_sandboxes, (held, live, reserved)
    return held, live, reserved


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)


async def _until(condition: Callable[[], bool], what: str, bound_s: float = 20.0) -> None:
    """Waits until ``condition()`` holds (calls reach the server in their own time on a
    busy machine); fails past ``bound_s``."""
    deadline = asyncio.get_running_loop().time() + bound_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {bound_s} s"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("reserve", [True, False])
def test_room_reserved_by_a_create_is_its_forks_whatever_other_clients_ask(tmp_path: Path, grpc_serving: Serving, reserve: bool) -> None:
    """Client A makes a base for a group of 2, client B fills the rest of the limit (4)
    before A forks. Reserved, A's Fork gets its 2 and B's extra Create is refused;
    without the reserve (what a client did before) B takes the room and A's Fork fails."""
    service = _service(tmp_path, 4)

    async def main() -> None:
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            notes = es.File(path="notes.txt", content=b"the base's")
            base = await stub.Create(es.CreateRequest(task_id="python/add", files=[notes], fork_reserve=2 if reserve else 0))
            assert _accounted(service) == ((3, 1, 2) if reserve else (1, 1, 0))
            other = await stub.Create(es.CreateRequest(task_id="python/add"))
            if reserve:
                details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Create(es.CreateRequest(task_id="python/add")))
                assert "live sandbox limit reached (4, 4 held)" in details, details
                forks = await stub.Fork(es.ForkRequest(sandbox_id=base.sandbox_id, count=2))
                assert len(forks.sandboxes) == 2 and _accounted(service) == (4, 4, 0)
                # The forks start from the base's workspace, as any fork does.
                files = await stub.ReadFiles(es.ReadFilesRequest(sandbox_id=forks.sandboxes[1].sandbox_id, paths=["notes.txt"]))
                assert files.files[0].content == b"the base's"
            else:
                await stub.Create(es.CreateRequest(task_id="python/add"))
                details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Fork(es.ForkRequest(sandbox_id=base.sandbox_id, count=2)))
                assert "forking 2 would exceed the live sandbox limit (4" in details, details
                assert _accounted(service) == (3, 3, 0)
            await stub.Close(es.CloseRequest(sandbox_id=other.sandbox_id))

    run(main())


def test_a_fork_past_its_reserve_takes_the_rest_from_free_room_and_a_close_returns_an_unused_reserve(tmp_path: Path, grpc_serving: Serving) -> None:
    service = _service(tmp_path, 5)

    async def main() -> None:
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            base = await stub.Create(es.CreateRequest(task_id="python/add", fork_reserve=2))
            await stub.Fork(es.ForkRequest(sandbox_id=base.sandbox_id, count=3))  # 2 reserved + 1 free
            assert _accounted(service) == (4, 4, 0)
            details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Fork(es.ForkRequest(sandbox_id=base.sandbox_id, count=2)))
            assert "forking 2 would exceed" in details
            for box in (await stub.List(es.ListRequest())).sandboxes:
                await stub.Close(es.CloseRequest(sandbox_id=box.sandbox_id))
            # A base closed with its reserve unused gives all of it back.
            unused = await stub.Create(es.CreateRequest(task_id="python/add", fork_reserve=4))
            assert _accounted(service) == (5, 1, 4)
            await stub.Fork(es.ForkRequest(sandbox_id=unused.sandbox_id, count=1))
            assert _accounted(service) == (5, 2, 3)
            await stub.Close(es.CloseRequest(sandbox_id=unused.sandbox_id))
            assert _accounted(service) == (1, 1, 0)

    run(main())


def test_waiting_creates_get_in_first_come_first_served_as_room_comes_back(tmp_path: Path, grpc_serving: Serving) -> None:
    """The limit (3) is full. A group's base (needing 3: itself and 2 forks) asks first,
    then a single sandbox: the single one fits first but waits behind the group, and
    each gets in once enough room is back. A Create that would not wait, and a Fork past
    its reserve, are refused while they wait, though one slot is free."""
    service = _service(tmp_path, 3)

    async def main() -> None:
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            held = [await stub.Create(es.CreateRequest(task_id="python/add")) for _ in range(3)]
            order: list[str] = []

            async def create(name: str, reserve: int) -> es.SandboxInfo:
                box = await stub.Create(es.CreateRequest(task_id="python/add", fork_reserve=reserve, wait_seconds=30), timeout=40)
                order.append(name)
                return box

            group = asyncio.create_task(create("group", 2))
            await _until(lambda: service.sandboxes.slots.waiting == 1, "the group's Create in line")
            single = asyncio.create_task(create("single", 0))
            await _until(lambda: service.sandboxes.slots.waiting == 2, "the single Create in line behind it")
            await stub.Close(es.CloseRequest(sandbox_id=held[0].sandbox_id))
            await _settle()
            assert order == [] and service.sandboxes.slots.waiting == 2
            details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Create(es.CreateRequest(task_id="python/add")))
            assert "2 Creates wait in line ahead" in details, details
            # Nor does a Fork past its (here no) reserve take the free slot from the line.
            await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Fork(es.ForkRequest(sandbox_id=held[1].sandbox_id, count=1)))
            for box in held[1:]:
                await stub.Close(es.CloseRequest(sandbox_id=box.sandbox_id))
            base = await asyncio.wait_for(group, 10)
            assert order == ["group"] and _accounted(service) == (3, 1, 2)
            await stub.Fork(es.ForkRequest(sandbox_id=base.sandbox_id, count=2))
            assert not single.done()
            for box in (await stub.List(es.ListRequest())).sandboxes:
                await stub.Close(es.CloseRequest(sandbox_id=box.sandbox_id))
            await asyncio.wait_for(single, 10)
            assert order == ["group", "single"] and _accounted(service) == (1, 1, 0)

    run(main())


def test_a_wait_that_ends_gives_its_place_back(tmp_path: Path, grpc_serving: Serving) -> None:
    """A Create whose wait runs out answers RESOURCE_EXHAUSTED naming it; one whose caller
    goes away (its deadline) leaves the line; a wait past the server's cap is cut to it.
    None of them keeps a slot: the room is whole again afterwards."""
    service = _service(tmp_path, 2, max_create_wait_s=0.5)

    async def main() -> None:
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            held = [await stub.Create(es.CreateRequest(task_id="python/add")) for _ in range(2)]
            details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Create(es.CreateRequest(wait_seconds=0.3), timeout=10))
            assert "no room for 1 sandboxes within 0.3 s" in details, details
            await expect_code(grpc.StatusCode.DEADLINE_EXCEEDED, stub.Create(es.CreateRequest(wait_seconds=30, fork_reserve=1), timeout=0.3))
            await _until(lambda: service.sandboxes.slots.waiting == 0, "the gone caller's Create out of the line")
            # Asked for an hour, waits the server's half second.
            details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Create(es.CreateRequest(wait_seconds=3600), timeout=10))
            assert "within 0.5 s" in details, details
            for box in held:
                await stub.Close(es.CloseRequest(sandbox_id=box.sandbox_id))
            assert _accounted(service) == (0, 0, 0)
            await stub.Create(es.CreateRequest(task_id="python/add", fork_reserve=1))
            assert _accounted(service) == (2, 1, 1)

    run(main())


@pytest.mark.parametrize(
    ("request_fields", "named"),
    [
        ({"fork_reserve": 4}, "fork_reserve must be in 0..3"),
        ({"wait_seconds": -1.0}, "wait_seconds must be finite"),
        ({"wait_seconds": float("nan")}, "wait_seconds must be finite"),
        ({"wait_seconds": float("inf")}, "wait_seconds must be finite"),
    ],
)
def test_a_reserve_or_wait_that_cannot_be_is_refused(tmp_path: Path, grpc_serving: Serving, request_fields: dict[str, Any], named: str) -> None:
    service = _service(tmp_path, 4)

    async def main() -> None:
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.Create(es.CreateRequest(task_id="python/add", **request_fields)))
            assert named in details, details
            assert _accounted(service) == (0, 0, 0)

    run(main())


def test_a_base_whose_lease_lapses_gives_its_reserve_back(tmp_path: Path, grpc_serving: Serving) -> None:
    """A rollout killed between its Create and its Fork never closes the base: the lease
    ends it, and with it the room it held for the forks."""
    service = EnvSandboxService(EnvSandboxConfig(root=str(tmp_path / "sandboxes"), max_sandboxes=3, reap_interval_s=0.1))

    async def main() -> None:
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            await stub.Create(es.CreateRequest(task_id="python/add", fork_reserve=2, lease_seconds=0.5))
            assert _accounted(service) == (3, 1, 2)
            # A waiting Create gets the room once the lease lapses.
            box = await stub.Create(es.CreateRequest(task_id="python/add", fork_reserve=2, wait_seconds=20), timeout=30)
            assert _accounted(service) == (3, 1, 2)
            assert [b.sandbox_id for b in (await stub.List(es.ListRequest())).sandboxes] == [box.sandbox_id]

    run(main())


def test_a_sandbox_being_torn_down_still_counts_until_the_backend_let_go_of_it(tmp_path: Path, grpc_serving: Serving) -> None:
    """The limit bounds what the host holds: while a closed sandbox's processes, mounts
    and uid are still being released, its slot is not free, so a Create that will not wait
    is refused and one that waits gets in once the teardown is over."""
    service = _service(tmp_path, 1)
    backend = service.sandboxes.backend
    real_destroy = backend.destroy
    let_go = asyncio.Event()

    async def slow_destroy(sandbox_id: str) -> None:
        await let_go.wait()
        await real_destroy(sandbox_id)

    async def main() -> None:
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = es_grpc.EnvSandboxStub(channel)
            first = await stub.Create(es.CreateRequest(task_id="python/add"))
            backend.destroy = slow_destroy  # type: ignore[method-assign]
            closing = asyncio.ensure_future(stub.Close(es.CloseRequest(sandbox_id=first.sandbox_id)))
            await _until(lambda: not service.sandboxes.list(), "the sandbox unlisted")
            details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Create(es.CreateRequest(task_id="python/add")))
            assert "live sandbox limit reached (1, 1 held)" in details, details
            waiting = asyncio.ensure_future(stub.Create(es.CreateRequest(task_id="python/add", wait_seconds=20), timeout=30))
            await _until(lambda: service.sandboxes.slots.waiting == 1, "the waiting Create in line")
            let_go.set()
            await closing
            second = await waiting
            assert [b.sandbox_id for b in (await stub.List(es.ListRequest())).sandboxes] == [second.sandbox_id]
            assert _accounted(service) == (1, 1, 0)

    run(main())


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"max_sandboxes": 4097}, "max_sandboxes must be at most 4096"), ({"max_create_wait_s": -1.0}, "max_create_wait_s must be finite"),
     ({"max_create_wait_s": float("inf")}, "max_create_wait_s must be finite")],
)
def test_a_limit_the_service_cannot_keep_is_refused_at_start(fields: dict[str, Any], named: str) -> None:
    """More live sandboxes than there are sandbox uids would fail at the first Create past
    the pool; a wait cap that is no number would never end a wait."""
    with pytest.raises(ValueError, match=named):
        EnvSandboxConfig(**fields)
