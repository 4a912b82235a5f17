"""gRPC adapter of the rollout service: Generate (production and RL on one engine),
RunEpisodes, Score, Status. It owns the components and their order -- the engine, the
OpenAI-compatible HTTP API on it, the background RL workers, and the weight follower that
applies new policy versions (weight_follower.py) -- and translates RPCs to them."""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
from opentelemetry.trace import Link, SpanKind

from meridian import credentials, metrics, telemetry
from meridian.errors import FailedPrecondition, InvalidArgument
from meridian.grpc_runtime import failure_of, open_channel
from meridian.model_store import resolve_model
from meridian.tensors import RawTensor, from_torch, weights_hash
from meridian.trajectory_transport import open_transport
from meridian.v1 import common_pb2
from meridian.v1 import envsandbox_pb2 as sbx
from meridian.v1 import envsandbox_pb2_grpc as sbx_grpc
from meridian.v1 import rollout_pb2 as pb
from meridian.v1 import rollout_pb2_grpc as pb_grpc
from services.rollout.callers import CallerClasses
from services.rollout.config import RolloutConfig
from services.rollout.engine import MAX_TEMPERATURE, PRIORITY_PRODUCTION, PRIORITY_RL, REJECTED_VERSION, Engine, Sampling
from services.envsandbox.client import LeaseKeeper, sandbox_limit
from services.rollout.episodes import SANDBOX_CALL_S, EpisodeLimits, fetch_task, gather_or_cancel, run_group
from services.rollout.prompt_limits import text_bytes, tokenize_off_loop, too_long
from services.rollout.sandbox_budget import SandboxBudget
from services.rollout.weight_follower import WeightFollower
from services.weightsync.signing import load_verifier
from services.rollout.weight_updates import Tolerance, WeightUpdater

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

MAX_GROUP = 64
MAX_TASKS = 64
MAX_STOPS = 16
#: Seconds between reads of envsandbox's sandbox limit (see RolloutService._follow_sandbox_limit).
LIMIT_REFRESH_S = 30.0


def load_checkpoint_weights(model_dir: Path) -> dict[str, RawTensor]:
    """The model folder's tensors as raw bits: version 0, the base the first delta decodes on."""
    from safetensors.torch import load_file

    weights: dict[str, RawTensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        weights.update({name: from_torch(t) for name, t in load_file(str(path)).items()})
    return weights


class RolloutService(pb_grpc.RolloutServicer):
    """Production inference and RL rollouts on one engine."""

    service_names = (pb.DESCRIPTOR.services_by_name["Rollout"].full_name,)

    def __init__(self, config: RolloutConfig) -> None:
        from services.rollout.publish_outbox import PublishOutbox
        from services.rollout.rl_workers import RLWorkers

        self.config = config
        self.engine: Engine | None = None
        self.transport = open_transport(config.transport_config())
        self._sandbox_channel = open_channel(config.envsandbox)
        self.sandboxes = sbx_grpc.EnvSandboxStub(self._sandbox_channel)
        self.leases = LeaseKeeper(self.sandboxes, config.sandbox_lease_s)
        self.limits = EpisodeLimits(config.max_turns, config.episode_wall_s, config.max_model_len)
        self.budget = SandboxBudget(config.sandbox_budget)
        self._limit_read_at = -math.inf  # when envsandbox's sandbox limit was last read
        self.loaded_hash = ""
        self.episodes_completed = 0
        self.episodes_discarded = 0
        self.follower: WeightFollower | None = None
        self._follow: asyncio.Task[None] | None = None
        self._http = None
        self.outbox = PublishOutbox(self._publish_group)
        self.workers = RLWorkers(config.rl_workers, self._background_group, self._backpressure)
        # With credentials (meridian serve's default) every caller needs a key; each key
        # is also a gRPC caller of role production (see meridian.access).
        identity = credentials.process_identity()
        self.callers = CallerClasses.load(config.caller_classes, config.anonymous_class) if identity is None else CallerClasses.authenticated(identity.folder, config.caller_classes)
        self.caller_roles = {digest: "production" for digest in self.callers.digests()}
        self.metrics = metrics.ServiceMetrics("rollout", self._metric_values)

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_RolloutServicer_to_server(self, server)

    async def start(self) -> None:
        model_dir = await asyncio.to_thread(resolve_model, self.config.model)
        self.engine = Engine(
            model_dir, self.config.max_model_len, self.config.kv_cache_gib, self.config.seed, self.config.update_policy, self.config.admission_config(),
            self.config.engine_cpus,
        )
        await self.engine.start()
        # Version 0 as loaded: the base the first delta decodes on (updated in place after).
        held = await asyncio.to_thread(load_checkpoint_weights, model_dir)
        self.loaded_hash = weights_hash(held)
        if self.config.weightsync:
            updater = WeightUpdater(self.engine, self.config.weight_apply, Tolerance(self.config.canary_mean_tolerance, self.config.canary_max_tolerance))
            await updater.prepare(held, sorted(model_dir.glob("*.safetensors")))
            verifier = load_verifier(self.config.verify_key)
            self.follower = WeightFollower(self.config.weightsync, updater, held, self.loaded_hash, verifier)
        del held
        # Warm-up: one real generation before reporting SERVING.
        async for _ in self.engine.generate([self.engine.tokenizer.bos_token_id or 0], Sampling(max_tokens=2), PRIORITY_PRODUCTION):
            pass
        if self.config.http_port >= 0:
            from services.rollout.openai_api import HttpFrontDoor, create_app, http_tls

            app = create_app(
                self.engine, self.config.model, self.config.max_model_len, self.config.max_tokens, self.callers, self.config.max_n,
                max_prompt_bytes=self.config.max_prompt_bytes, max_body_bytes=self.config.http_max_body_bytes,
            )
            tls = http_tls(self.config.http_host, credentials.process_identity())
            self._http = HttpFrontDoor(app, self.config.http_host, self.config.http_port, tls, self.config.http_max_concurrency)
            port = await self._http.start()
            # The stack launcher reads this line; keep its shape stable.
            print(f"meridian rollout http listening on {self.config.http_host}:{port}", flush=True)
        if self.follower is not None:
            self._follow = asyncio.create_task(self.follower.run())
        self.leases.start()
        self.outbox.start()
        self.workers.start()

    async def failure(self) -> str:
        """Returns once the weight follower has ended, which it does only on an error
        it cannot recover from (a version neither applied nor rolled back: the weights
        the engine computes with are unknown, and its gate stays closed)."""
        return await failure_of(self._follow, "the weight follower")  # no follower: nothing here can fail

    async def stop(self) -> None:
        # Ordered: stop producing work, stop the front doors, then the engine last; every
        # step runs even when one before it failed, so the engine's processes never outlive us.
        try:
            await self.workers.stop()
            await self.leases.stop()
            await self.outbox.stop()
            if self._http is not None:
                await self._http.stop()
            if self._follow:
                self._follow.cancel()
                await asyncio.wait({self._follow})  # its error, if it died of one, is failure()'s to report
        finally:
            try:
                await self._sandbox_channel.close()
                await self.transport.close()
            finally:
                if self.engine:
                    self.engine.shutdown()

    # ------------------------------------------------------------ RL work

    async def _backpressure(self) -> str:
        """Why RL workers should wait now ('' when they may run)."""
        if self.outbox.held:
            return f"{self.outbox.held} sampled groups wait for the trajectory stream"
        backlog = await self.transport.backlog()
        if backlog > self.config.rl_high_water:
            return f"stream backlog {backlog} groups > {self.config.rl_high_water}"
        lag = self.follower.lag() if self.follower is not None else 0
        if lag > self.config.rl_max_lag:
            return f"policy lag {lag} > {self.config.rl_max_lag}"
        return ""

    async def _follow_sandbox_limit(self) -> None:
        """Keeps the sandbox budget within envsandbox's own limit, read again at most every
        LIMIT_REFRESH_S (an envsandbox restarted with another --max-sandboxes is followed).
        A failed read keeps the budget as it is: the groups' own calls report the outage."""
        if time.monotonic() - self._limit_read_at < LIMIT_REFRESH_S:
            return
        try:
            limit = await sandbox_limit(self.sandboxes, SANDBOX_CALL_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not read envsandbox's sandbox limit (%s: %s); the budget stays %d", exc.code().name, exc.details(), self.budget.capacity)
            return
        self._limit_read_at = time.monotonic()
        if limit and limit < self.budget.configured and limit != self.budget.envsandbox_limit:
            log.info("envsandbox holds %d sandboxes at most: the sandbox budget is %d, not --sandbox-budget %d", limit, limit, self.budget.configured)
        self.budget.limit_to(limit)

    async def _background_group(self) -> None:
        await self._follow_sandbox_limit()
        groups = await self._run_groups(await self._pick_tasks(1), self.config.group_size, self._sampling(pb.SamplingParams(), self.config.temperature))
        await self.outbox.publish(groups, landed=self._rl_group_landed)

    def _rl_group_landed(self, group: list[common_pb2.Trajectory]) -> None:
        self.workers.published += len(group)

    async def _publish_group(self, group: list[common_pb2.Trajectory]) -> None:
        """XADDs one group under a PRODUCER span linked to each trajectory's episode span
        (the context the trainer's step links to as well)."""
        links = [Link(ctx) for t in group if (ctx := telemetry.span_context_of(dict(t.trace_context)))]
        with tracer.start_as_current_span("rollout.publish_group", kind=SpanKind.PRODUCER, links=links) as span:
            span.set_attribute("messaging.system", "redis")
            span.set_attribute("messaging.operation.type", "send")
            span.set_attribute("messaging.destination.name", self.config.stream)
            span.set_attribute("meridian.group_id", group[0].group_id if group else "")
            span.set_attribute("meridian.trajectories", len(group))
            await self.transport.publish_group(group)

    async def _pick_tasks(self, count: int) -> list[sbx.Task]:
        listed = (await self.sandboxes.ListTasks(sbx.ListTasksRequest(split="train"), timeout=SANDBOX_CALL_S)).tasks
        if not listed:
            raise FailedPrecondition("envsandbox has no training tasks")
        return random.sample(list(listed), k=min(len(listed), count))

    async def _run_groups(self, tasks: list[sbx.Task], group_size: int, sampling: Sampling) -> list[list[common_pb2.Trajectory]]:
        """Samples one group per task. A group with tokens from a version that was then
        rejected is dropped whole: no policy produced those samples."""
        engine = self._engine()
        groups = await gather_or_cancel([run_group(engine, self.sandboxes, t, group_size, sampling, self.config.model, self.limits, self.leases, self.budget, self.config.sandbox_wait_s) for t in tasks])
        kept = [g for g in groups if not any(REJECTED_VERSION in t.policy_versions for t in g)]
        for t in (t for g in kept for t in g):
            t.region = self.config.region
        self.episodes_discarded += sum(len(g) for g in groups) - sum(len(g) for g in kept)
        self.episodes_completed += sum(len(g) for g in kept)
        return kept

    # ------------------------------------------------------------ RPCs

    def _sampling(self, params: pb.SamplingParams, default_temperature: float) -> Sampling:
        # Chained comparisons are False for NaN: a NaN fails both checks.
        if not 0 <= params.temperature <= MAX_TEMPERATURE or not 0 <= params.top_p <= 1:
            raise InvalidArgument(f"temperature must be in [0, {MAX_TEMPERATURE}] and top_p in [0, 1], got {params.temperature}, {params.top_p}")
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

    async def _prompt_ids(self, prompt: str, token_ids: Sequence[int]) -> list[int]:
        """The prompt as token ids: text is measured before it is tokenised (and large
        text is tokenised off the event loop, see :mod:`services.rollout.prompt_limits`);
        ids (the request's repeated field, not yet a list) are counted before they are read."""
        engine = self._engine()
        if bool(prompt) == bool(len(token_ids)):
            raise InvalidArgument("give exactly one of prompt or prompt_token_ids")
        ids: Sequence[int]
        if token_ids:
            ids = token_ids
        else:
            size = text_bytes(prompt)
            if problem := too_long(size, self.config.max_prompt_bytes):
                raise InvalidArgument(problem)
            ids = list((await tokenize_off_loop(size, engine.tokenizer, prompt))["input_ids"])  # type: ignore[arg-type]
        if problem := engine.prompt_problem(ids):
            raise InvalidArgument(problem)
        return list(ids)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        sampling = self._sampling(request.sampling, default_temperature=0.0)
        ids = await self._prompt_ids(request.prompt, request.prompt_token_ids)
        priority = self.callers.classify(dict(context.invocation_metadata() or ()).get("authorization"))
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
        ids = await self._prompt_ids("", request.token_ids)
        if len(ids) < 2:
            raise InvalidArgument("score needs at least two tokens")
        priority = self.callers.classify(dict(context.invocation_metadata() or ()).get("authorization"))
        engine = self._engine()
        version = engine.version
        return pb.ScoreResponse(logprobs=await engine.score(ids, priority=priority), policy_version=version)

    async def RunEpisodes(self, request: pb.RunEpisodesRequest, context: grpc.aio.ServicerContext) -> pb.RunEpisodesResponse:
        group_size = request.group_size or self.config.group_size
        if not 2 <= group_size <= MAX_GROUP:
            raise InvalidArgument(f"group_size must be in 2..{MAX_GROUP}, got {group_size}")
        await self._follow_sandbox_limit()
        if problem := self.budget.problem(group_size + 1):
            raise InvalidArgument(problem)
        if len(request.task_ids) > MAX_TASKS or not 0 <= request.num_tasks <= MAX_TASKS:
            raise InvalidArgument(f"at most {MAX_TASKS} tasks per call")
        sampling = self._sampling(request.sampling, default_temperature=self.config.temperature)
        if request.publish:
            # Groups held from an outage go first; while the stream is still down, say so
            # before sampling more that could not be published either.
            await self.outbox.flush()
        if request.task_ids:
            tasks = [await fetch_task(self.sandboxes, tid) for tid in request.task_ids]
        else:
            tasks = await self._pick_tasks(request.num_tasks or 1)
        groups = await self._run_groups(tasks, group_size, sampling)
        if request.publish:
            await self.outbox.publish(groups)
        return pb.RunEpisodesResponse(trajectories=[t for g in groups for t in g])

    async def Status(self, request: pb.RolloutStatusRequest, context: grpc.aio.ServicerContext) -> pb.RolloutStatus:
        follower = self.follower
        last = follower.last_update if follower else None
        return pb.RolloutStatus(
            region=self.config.region,
            sandboxes_held=self.budget.held,
            groups_waiting_for_sandboxes=self.budget.waiting,
            sandbox_budget=self.budget.capacity,
            policy_version=self.engine.version if self.engine else 0,
            model=self.config.model,
            weights_hash=follower.weights_hash if follower else self.loaded_hash,
            episodes_completed=self.episodes_completed,
            updates_applied=follower.updates_applied if follower else 0,
            weightsync_address=self.config.weightsync,
            latest_published_version=follower.latest_published if follower else -1,
            rl_state=self.workers.state,
            rl_trajectories_published=self.workers.published,
            http_port=self._http.port if self._http is not None else 0,
            last_apply_ms=last.apply_ms if last else 0.0,
            apply_path=last.path if last else "",
            updates_rejected=follower.updates_rejected if follower else 0,
            rejected_version=follower.rejected_version if follower else -1,
            last_update_error=follower.last_update_error if follower else "",
            canary_mean_diff=last.canary.mean_diff if last and last.canary else 0.0,
            canary_max_diff=last.canary.max_diff if last and last.canary else 0.0,
            readback_elements=last.readback_elements if last else 0,
            **self._admission_status(),
        )

    def _admission_status(self) -> dict[str, float | int]:
        if self.engine is None:
            return {}
        scheduler = self.engine.scheduler
        tokens = self.engine.tokens_generated
        total = sum(tokens.values())
        return {
            "rl_concurrency_limit": scheduler.allowed(scheduler.clock()),
            "rl_running": scheduler.rl_running,
            "rl_preemptions": scheduler.preemptions,
            "slo_attainment": scheduler.controller.attainment,
            "rl_token_share": tokens[PRIORITY_RL] / total if total else 0.0,
            "production_in_flight": scheduler.production_active,
            "rl_tokens": tokens[PRIORITY_RL],
            "production_tokens": tokens[PRIORITY_PRODUCTION],
        }

    async def _metric_values(self) -> list[metrics.Value]:
        """What the metrics endpoint exports: the Status figures and the stream backlog."""
        return metrics.rollout_values(await self.Status(pb.RolloutStatusRequest(), None), await self.transport.backlog())  # type: ignore[arg-type]

    def _engine(self) -> Engine:
        if self.engine is None or self.engine.tokenizer is None:
            raise FailedPrecondition("the engine is still starting")
        return self.engine
