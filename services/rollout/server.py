"""gRPC adapter of the rollout service: Generate (production and RL on one engine),
RunEpisodes, Score, Status; the OpenAI-compatible HTTP API on the same engine; the
background RL workers; and the subscription that applies new policy versions in place."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from meridian.errors import DataLoss, FailedPrecondition, InvalidArgument
from meridian.grpc_runtime import open_channel
from meridian.model_store import resolve_model
from meridian.trajectory_stream import TrajectoryStream
from meridian.v1 import envsandbox_pb2 as sbx
from meridian.v1 import envsandbox_pb2_grpc as sbx_grpc
from meridian.v1 import rollout_pb2 as pb
from meridian.v1 import rollout_pb2_grpc as pb_grpc
from services.rollout.config import RolloutConfig
from services.rollout.engine import PRIORITY_PRODUCTION, PRIORITY_RL, REJECTED_VERSION, Engine, Sampling
from services.rollout.episodes import EpisodeLimits, fetch_task, run_group
from services.rollout.weight_changes import ChangeSet
from services.rollout.weight_updates import Tolerance, UpdateReport, WeightUpdater
from services.weightsync import client as weightsync
from services.weightsync.receiver import UndoLog
from meridian.tensors import RawTensor, Weights, from_torch, weights_hash

log = logging.getLogger(__name__)

MAX_GROUP = 64
MAX_TASKS = 64
MAX_STOPS = 16
TRAINER_GROUP = "trainer"


def load_checkpoint_weights(model_dir: Path) -> dict[str, RawTensor]:
    """The model folder's tensors as raw bits: version 0, the base the first delta decodes on."""
    from safetensors.torch import load_file

    weights: dict[str, RawTensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        weights.update({name: from_torch(t) for name, t in load_file(str(path)).items()})
    return weights


def _served_version(weights: Weights, pending: list[UndoLog]) -> dict[str, RawTensor]:
    """The version the engine serves, rebuilt from the decoder's newer ``weights`` and the
    undo logs of the versions after it (copies only the tensors they touched)."""
    served = dict(weights)
    for undo in reversed(pending):
        served = undo.previous_weights(served)
    return served


class RolloutService(pb_grpc.RolloutServicer):
    """Production inference and RL rollouts on one engine."""

    service_names = (pb.DESCRIPTOR.services_by_name["Rollout"].full_name,)

    def __init__(self, config: RolloutConfig) -> None:
        from services.rollout.rl_workers import RLWorkers

        self.config = config
        self.engine: Engine | None = None
        self.stream = TrajectoryStream.from_url(config.redis_url, config.stream)
        self._sandbox_channel = open_channel(config.envsandbox)
        self.sandboxes = sbx_grpc.EnvSandboxStub(self._sandbox_channel)
        self.limits = EpisodeLimits(config.max_turns, config.episode_wall_s, config.max_model_len)
        self.weights_hash = ""
        self.episodes_completed = 0
        self.episodes_discarded = 0
        self.updates_applied = 0
        self.latest_published = -1
        self.last_update: UpdateReport | None = None
        self.updates_rejected = 0
        self.rejected_version = -1
        self.last_update_error = ""
        self.updater: WeightUpdater | None = None
        self._follow: asyncio.Task[None] | None = None
        self._held: dict[str, RawTensor] = {}
        self._http = None
        self.workers = RLWorkers(config.rl_workers, self._background_group, self._backpressure)

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_RolloutServicer_to_server(self, server)

    async def start(self) -> None:
        model_dir = await asyncio.to_thread(resolve_model, self.config.model)
        self.engine = Engine(model_dir, self.config.max_model_len, self.config.kv_cache_gib, self.config.seed, self.config.update_policy, self.config.rl_quiet_ms / 1000)
        await self.engine.start()
        # Version 0 as loaded: the base the first delta decodes on (updated in place after).
        self._held = await asyncio.to_thread(load_checkpoint_weights, model_dir)
        self.weights_hash = weights_hash(self._held)
        self.updater = WeightUpdater(self.engine, self.config.weight_apply, Tolerance(self.config.canary_mean_tolerance, self.config.canary_max_tolerance))
        await self.updater.prepare(self._held, sorted(model_dir.glob("*.safetensors")))
        # Warm-up: one real generation before reporting SERVING.
        async for _ in self.engine.generate([self.engine.tokenizer.bos_token_id or 0], Sampling(max_tokens=2), PRIORITY_PRODUCTION):
            pass
        if self.config.http_port >= 0:
            from services.rollout.openai_api import HttpFrontDoor, create_app

            app = create_app(self.engine, self.config.model, self.config.max_model_len, self.config.max_tokens)
            self._http = HttpFrontDoor(app, self.config.http_host, self.config.http_port)
            port = await self._http.start()
            # The stack launcher reads this line; keep its shape stable.
            print(f"meridian rollout http listening on {self.config.http_host}:{port}", flush=True)
        if self.config.weightsync:
            self._follow = asyncio.create_task(self._follow_weights())
        self.workers.start()

    async def stop(self) -> None:
        # Ordered: stop producing work, stop the front doors, then the engine last; every
        # step runs even when one before it failed, so the engine's processes never outlive us.
        try:
            await self.workers.stop()
            if self._http is not None:
                await self._http.stop()
            if self._follow:
                self._follow.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._follow
        finally:
            try:
                await self._sandbox_channel.close()
                await self.stream.close()
            finally:
                if self.engine:
                    self.engine.shutdown()

    async def _follow_weights(self) -> None:
        """Applies every new version from weightsync; a rejected one leaves the previous
        version served, and the next version is applied on top of both."""
        updater = self.updater
        assert updater is not None, "start() prepares the updater"
        weights, version = self._held, 0
        pending: list[UndoLog] = []  # versions decoded but not yet served, oldest first
        while True:
            subscriber = weightsync.WeightSubscriber(self.config.weightsync, weights, version, in_place=True)
            try:
                async for update in subscriber.updates(follow=True):
                    self.latest_published = max(self.latest_published, update.version)
                    weights, version = update.weights, update.version
                    assert update.undo is not None, "an in-place subscriber records undo logs"
                    pending.append(update.undo)
                    changes = await asyncio.to_thread(ChangeSet.from_undos, weights, pending)
                    report = await updater.update(changes, weights, update.manifest.canary, lambda w=weights, p=pending: _served_version(w, p))
                    self._record(report, update.manifest.weights_hash)
                    if report.accepted:
                        pending.clear()
            except asyncio.CancelledError:
                raise
            except (DataLoss, FailedPrecondition) as exc:
                log.warning("weight update failed (%s); asking for a keyframe", exc)
                weights, version, pending = {}, -1, []
            except grpc.aio.AioRpcError as exc:
                log.warning("weightsync %s: %s; reconnecting", self.config.weightsync, exc.code().name)
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

    # ------------------------------------------------------------ RL work

    async def _backpressure(self) -> str:
        """Why RL workers should wait now ('' when they may run)."""
        backlog = await self.stream.backlog(TRAINER_GROUP)
        if backlog > self.config.rl_high_water:
            return f"stream backlog {backlog} > {self.config.rl_high_water}"
        if self.config.weightsync:
            with contextlib.suppress(grpc.aio.AioRpcError):
                self.latest_published = max(self.latest_published, await weightsync.latest_version(self.config.weightsync, timeout_s=2.0))
        lag = self.latest_published - self._engine().version
        if lag > self.config.max_policy_lag:
            return f"policy lag {lag} > {self.config.max_policy_lag}"
        return ""

    async def _background_group(self) -> int:
        trajectories = await self._run_groups(await self._pick_tasks(1), self.config.group_size, self._sampling(pb.SamplingParams(), self.config.temperature))
        for traj in trajectories:
            await self.stream.publish(traj)
        return len(trajectories)

    async def _pick_tasks(self, count: int) -> list[sbx.Task]:
        listed = (await self.sandboxes.ListTasks(sbx.ListTasksRequest(split="train"))).tasks
        if not listed:
            raise FailedPrecondition("envsandbox has no training tasks")
        return random.sample(list(listed), k=min(len(listed), count))

    async def _run_groups(self, tasks: list[sbx.Task], group_size: int, sampling: Sampling) -> list:  # type: ignore[type-arg]
        """Samples one group per task. A group with tokens from a version that was then
        rejected is dropped whole: no policy produced those samples."""
        engine = self._engine()
        groups = await asyncio.gather(*(run_group(engine, self.sandboxes, t, group_size, sampling, self.config.model, self.limits) for t in tasks))
        kept = [g for g in groups if not any(REJECTED_VERSION in t.policy_versions for t in g)]
        self.episodes_discarded += sum(len(g) for g in groups) - sum(len(g) for g in kept)
        trajectories = [t for g in kept for t in g]
        self.episodes_completed += len(trajectories)
        return trajectories

    # ------------------------------------------------------------ RPCs

    def _sampling(self, params: pb.SamplingParams, default_temperature: float) -> Sampling:
        if params.temperature < 0 or not 0 <= params.top_p <= 1:
            raise InvalidArgument(f"temperature must be >= 0 and top_p in [0, 1], got {params.temperature}, {params.top_p}")
        if params.max_tokens < 0 or params.max_tokens >= self.config.max_model_len:
            raise InvalidArgument(f"max_tokens must be in 0..{self.config.max_model_len - 1}, got {params.max_tokens}")
        if len(params.stop) > MAX_STOPS or any(not s for s in params.stop):
            raise InvalidArgument(f"at most {MAX_STOPS} non-empty stop sequences")
        if not 0 <= params.min_tokens <= (params.max_tokens or self.config.max_tokens):
            raise InvalidArgument(f"min_tokens must be in 0..max_tokens, got {params.min_tokens}")
        return Sampling(
            temperature=params.temperature if params.HasField("temperature") else default_temperature,
            top_p=params.top_p or 1.0,
            max_tokens=params.max_tokens or self.config.max_tokens,
            stop=tuple(params.stop),
            seed=params.seed if params.HasField("seed") else None,
            min_tokens=params.min_tokens,
        )

    def _prompt_ids(self, prompt: str, token_ids: list[int]) -> list[int]:
        engine = self._engine()
        if bool(prompt) == bool(token_ids):
            raise InvalidArgument("give exactly one of prompt or prompt_token_ids")
        ids = token_ids or list(engine.tokenizer(prompt)["input_ids"])  # type: ignore[misc]
        if problem := engine.prompt_problem(ids):
            raise InvalidArgument(problem)
        return ids

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        ids = self._prompt_ids(request.prompt, list(request.prompt_token_ids))
        sampling = self._sampling(request.sampling, default_temperature=0.0)
        priority = PRIORITY_RL if request.priority == pb.PRIORITY_RL else PRIORITY_PRODUCTION
        async for delta in self._engine().generate(ids, sampling, priority, request.request_id):
            yield pb.GenerateChunk(
                token_ids=delta.token_ids,
                logprobs=delta.logprobs,
                policy_versions=[delta.version] * len(delta.token_ids),
                text=delta.text,
                finished=delta.finished,
                finish_reason=delta.finish_reason,
                completion_policy_versions=delta.all_versions or [],
            )

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        ids = self._prompt_ids("", list(request.token_ids))
        if len(ids) < 2:
            raise InvalidArgument("score needs at least two tokens")
        engine = self._engine()
        version = engine.version
        return pb.ScoreResponse(logprobs=await engine.score(ids), policy_version=version)

    async def RunEpisodes(self, request: pb.RunEpisodesRequest, context: grpc.aio.ServicerContext) -> pb.RunEpisodesResponse:
        group_size = request.group_size or self.config.group_size
        if not 2 <= group_size <= MAX_GROUP:
            raise InvalidArgument(f"group_size must be in 2..{MAX_GROUP}, got {group_size}")
        if len(request.task_ids) > MAX_TASKS or not 0 <= request.num_tasks <= MAX_TASKS:
            raise InvalidArgument(f"at most {MAX_TASKS} tasks per call")
        sampling = self._sampling(request.sampling, default_temperature=self.config.temperature)
        if request.task_ids:
            tasks = [await fetch_task(self.sandboxes, tid) for tid in request.task_ids]
        else:
            tasks = await self._pick_tasks(request.num_tasks or 1)
        trajectories = await self._run_groups(tasks, group_size, sampling)
        if request.publish:
            for traj in trajectories:
                await self.stream.publish(traj)
        return pb.RunEpisodesResponse(trajectories=trajectories)

    async def Status(self, request: pb.RolloutStatusRequest, context: grpc.aio.ServicerContext) -> pb.RolloutStatus:
        last = self.last_update
        return pb.RolloutStatus(
            policy_version=self.engine.version if self.engine else 0,
            model=self.config.model,
            weights_hash=self.weights_hash,
            episodes_completed=self.episodes_completed,
            updates_applied=self.updates_applied,
            weightsync_address=self.config.weightsync,
            latest_published_version=self.latest_published,
            rl_state=self.workers.state,
            rl_trajectories_published=self.workers.published,
            http_port=self._http.port if self._http is not None else 0,
            last_apply_ms=last.apply_ms if last else 0.0,
            apply_path=last.path if last else "",
            updates_rejected=self.updates_rejected,
            rejected_version=self.rejected_version,
            last_update_error=self.last_update_error,
            canary_mean_diff=last.canary.mean_diff if last and last.canary else 0.0,
            canary_max_diff=last.canary.max_diff if last and last.canary else 0.0,
            readback_elements=last.readback_elements if last else 0,
        )

    def _engine(self) -> Engine:
        if self.engine is None or self.engine.tokenizer is None:
            raise FailedPrecondition("the engine is still starting")
        return self.engine
