"""Rollout's weight follower: subscribes to weightsync from the version the engine serves,
hands every new version to the :class:`~services.rollout.weight_updates.WeightUpdater`,
and knows how far behind the newest published version the engine is (from the manifests
it receives, without asking weightsync)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc

from meridian.errors import DataLoss, FailedPrecondition, InvalidArgument
from meridian.grpc_runtime import describe_error
from meridian.tensors import RawTensor, Weights
from meridian.v1 import weightsync_pb2 as wpb
from services.rollout.weight_changes import ChangeSet
from services.rollout.weight_updates import UpdateReport, WeightUpdater
from services.weightsync import client as weightsync
from services.weightsync.client import UndoLog
from services.weightsync.config import DEFAULT_CHUNK_MB
from services.weightsync.signing import SignatureRefused, Verifier

log = logging.getLogger(__name__)


class EngineStateUnknown(RuntimeError):
    """An update failed past the point where it could be undone: what the engine
    computes with is not known, so the follower (and the service) stop."""


def served_version(weights: Weights, pending: list[UndoLog]) -> dict[str, RawTensor]:
    """The version the engine serves, rebuilt from the decoder's newer ``weights`` and the
    undo logs of the versions after it (copies only the tensors they touched).

    Raises when it cannot be: after the follower dropped its held weights (a version it
    could not decode), the oldest pending version is a keyframe onto nothing, and what it
    rebuilds is an empty model. A full roll-back must not reload that (vLLM only warns
    about weights it did not get, and keeps computing with the rejected ones)."""
    served = dict(weights)
    for undo in reversed(pending):
        served = undo.previous_weights(served)
    if weights and not served:
        raise RuntimeError(
            f"the served version cannot be rebuilt: the held weights were dropped before version {pending[0].version} arrived as a keyframe"
        )
    return served


class WeightFollower:
    """Applies each version weightsync publishes; a rejected one leaves the previous
    version served, and the next one is applied on top of every version not yet served.
    With a ``verifier`` a version the trainer's key did not sign (or whose weights are not
    the signed ones) is refused before it reaches the updater: the engine keeps serving
    what it serves, the held weights stay, and the follower asks again later."""

    def __init__(
        self, address: str, updater: WeightUpdater, weights: Mapping[str, RawTensor], weights_hash: str, verifier: Verifier | None = None
    ) -> None:
        self.address = address
        self.verifier = verifier
        self.updater = updater
        self._weights = dict(weights)
        self.weights_hash = weights_hash
        self.latest_published = -1
        self.last_update: UpdateReport | None = None
        self.updates_applied = 0
        self.updates_rejected = 0
        self.rejected_version = -1
        self.last_update_error = ""

    def lag(self) -> int:
        """Versions published that the engine does not serve yet (0 before any is known)."""
        return max(0, self.latest_published - self.updater.engine.version)

    def _seen(self, manifest: wpb.Manifest) -> None:
        self.latest_published = max(self.latest_published, manifest.version)

    async def run(self) -> None:
        """Follows until cancelled, reconnecting after a transport failure and starting over
        from a keyframe when the held weights can no longer be trusted; raises
        :class:`EngineStateUnknown` when an update could not be undone."""
        weights, version = self._weights, self.updater.engine.version
        self._weights = {}  # the subscriber's decoder owns (and updates) them from here
        pending: list[UndoLog] = []  # versions decoded but not yet served, oldest first
        while True:
            subscriber = weightsync.WeightSubscriber(
                self.address, weights, version, in_place=True, on_manifest=self._seen, verifier=self.verifier,
                # Prepares the held weights for the next delta while it is awaited.
                origin_chunk_bytes=int(DEFAULT_CHUNK_MB * (1 << 20)),
            )
            try:
                async for update in subscriber.updates(follow=True):
                    weights, version = update.weights, update.version
                    assert update.undo is not None, "an in-place subscriber records undo logs"
                    pending.append(update.undo)
                    changes = await asyncio.to_thread(ChangeSet.from_undos, weights, pending)
                    try:
                        report = await self.updater.update(
                            changes, weights, update.manifest.canary, lambda w=weights, p=pending: served_version(w, p), update.manifest.trace_context
                        )
                    except Exception as exc:
                        raise EngineStateUnknown(f"version {update.version} was neither applied nor rolled back: {describe_error(exc)}") from exc
                    self._record(report, update.manifest.weights_hash)
                    if report.accepted:
                        pending.clear()
            except (asyncio.CancelledError, EngineStateUnknown):
                raise
            except SignatureRefused as exc:
                # The decoder reverted the refused version: the held weights are still `version`.
                log.error("%s; still serving version %d", exc, self.updater.engine.version)
                self.updates_rejected += 1
                self.last_update_error = str(exc)
            except (DataLoss, FailedPrecondition, InvalidArgument) as exc:
                # InvalidArgument: the decoder refused what weightsync sent (a dtype this
                # build does not know, a chunk the manifest does not list).
                log.warning("weight update failed (%s); asking for a keyframe", exc)
                weights, version, pending = {}, -1, []
            except grpc.aio.AioRpcError as exc:
                log.warning("weightsync %s: %s; reconnecting", self.address, exc.code().name)
            finally:
                await subscriber.close()
            await asyncio.sleep(1.0)

    def _record(self, report: UpdateReport, manifest_hash: str) -> None:
        self.last_update = report
        if report.accepted:
            self.weights_hash = manifest_hash
            self.updates_applied += 1
            log.info(
                "serving policy version %d (%s) via the %s path in %.0f ms (%s); %d elements written, %d read back; canary %s",
                report.version, manifest_hash[:12], report.path, report.apply_ms,
                ", ".join(f"{k} {v:.0f}" for k, v in report.timings.items()), report.elements, report.readback_elements,
                f"mean {report.canary.mean_diff:.3f} max {report.canary.max_diff:.3f}" if report.canary else "absent",
            )
        else:
            self.updates_rejected += 1
            self.rejected_version, self.last_update_error = report.version, report.error
