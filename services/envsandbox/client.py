"""envsandbox's client side: keeping the leases of the sandboxes a process holds, and
reading how many it may hold.

A sandbox made with a lease (``CreateRequest.lease_seconds``) is closed by envsandbox once
nothing has used or renewed it for that long. A process that holds sandboxes (rollout's
episodes) runs one :class:`LeaseKeeper`: while the process lives its sandboxes are renewed,
and when it dies (killed mid-episode, its Close calls never sent) they are closed a lease
later instead of living to their time-to-live and holding the envsandbox's capacity.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterable

import grpc

from meridian.v1 import envsandbox_pb2 as pb
from meridian.v1 import envsandbox_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


async def sandbox_limit(stub: pb_grpc.EnvSandboxStub, timeout_s: float) -> int:
    """envsandbox's live sandbox limit (its --max-sandboxes); 0 from a server too old to say."""
    reply = await stub.List(pb.ListRequest(), timeout=timeout_s)
    return reply.max_sandboxes


class LeaseKeeper:
    """Renews the leases of the sandboxes this process holds: every third of a lease, one
    Renew call names them all. A renewal that fails is retried at the next tick, so one
    lost call or a slow envsandbox costs nothing; three in a row lose the sandboxes."""

    def __init__(self, stub: pb_grpc.EnvSandboxStub, lease_s: float) -> None:
        if not (math.isfinite(lease_s) and lease_s >= 0):
            raise ValueError(f"lease_s must be a finite number >= 0 (0: no lease), got {lease_s}")
        self.stub = stub
        self.lease_s = lease_s
        self._held: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    @property
    def held(self) -> frozenset[str]:
        """The sandbox ids renewed at the next tick."""
        return frozenset(self._held)

    def hold(self, sandbox_ids: Iterable[str]) -> None:
        """Renews ``sandbox_ids`` from now on (no-op without a lease)."""
        if self.lease_s > 0:
            self._held.update(sandbox_ids)

    def release(self, sandbox_ids: Iterable[str]) -> None:
        """Stops renewing ``sandbox_ids`` (closed, or left to their lease)."""
        self._held.difference_update(sandbox_ids)

    async def renew_once(self) -> list[str]:
        """One Renew call for every held sandbox; returns (and stops renewing) the ids
        envsandbox no longer has."""
        ids = sorted(self._held)
        if not ids:
            return []
        reply = await self.stub.Renew(pb.RenewRequest(sandbox_ids=ids), timeout=self.lease_s / 3)
        gone = list(reply.gone)
        self.release(gone)
        return gone

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                gone = await self.renew_once()
            except grpc.aio.AioRpcError as exc:
                log.warning("renewing %d sandbox leases failed (%s: %s); retrying in %.1f s",
                            len(self._held), exc.code().name, exc.details(), self.lease_s / 3)
                continue
            except Exception:  # noqa: BLE001 - the keeper outlives any one failed call
                log.exception("renewing %d sandbox leases failed", len(self._held))
                continue
            if gone:
                log.info("%d held sandboxes are gone at envsandbox (closed, expired or restarted)", len(gone))

    def start(self) -> None:
        """Starts renewing in the background (nothing to do without a lease)."""
        if self.lease_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stops renewing; the held sandboxes then close a lease later unless closed first."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
