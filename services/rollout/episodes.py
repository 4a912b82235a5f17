"""RL episodes: a GRPO group of multi-turn agent episodes for one task, each in its own
forked sandbox, built into trajectories whose model tokens, log-probs and versions come
straight from the engine (nothing is re-tokenised; tool output is masked out)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from meridian import telemetry
from meridian.errors import FailedPrecondition, NotFound
from meridian.v1 import common_pb2
from meridian.v1 import envsandbox_pb2 as sbx
from meridian.v1 import envsandbox_pb2_grpc as sbx_grpc
from services.envsandbox.client import LeaseKeeper
from services.rollout.agent import (
    SYSTEM_PROMPT,
    TOOL_CALL_CLOSE,
    Ledger,
    ToolCall,
    extract_answer,
    format_observation,
    parse_tool_call,
    tool_response,
)
from services.rollout.chat_template import ContentNotPlain, chat_ids, plain_ids, template_ids
from services.rollout.engine import PRIORITY_RL, PolicyEngine, Sampling
from services.rollout.sandbox_budget import SandboxBudget

tracer = telemetry.tracer(__name__)
log = logging.getLogger(__name__)
T = TypeVar("T")

TOOL_TIMEOUT_S = 10.0
#: Client deadline of an envsandbox call (on top of a tool's own timeout for Exec). A live
#: envsandbox bounds every call itself; this catches one that stopped answering (frozen,
#: or a partition that drops replies), which would otherwise hang the episode for good.
SANDBOX_CALL_S = 60.0


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    wall_s: float = 300.0
    max_model_len: int = 2048


def chat_prompt(engine: PolicyEngine, task: sbx.Task) -> list[int]:
    """The prompt's token ids through the model's own chat template. The instruction is
    the task's text (a GitHub issue's, for SWE-bench), so it stays text: a turn marker it
    spells does not open a turn (see :mod:`services.rollout.chat_template`)."""
    assert engine.tokenizer is not None
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT.replace("{answer_path}", task.answer_path)},
        {"role": "user", "content": task.instruction},
    ]
    try:
        return chat_ids(engine.tokenizer, messages)
    except ContentNotPlain as exc:
        raise FailedPrecondition(f"task {task.id!r} cannot be prompted with this model's chat template: {exc}") from exc


_PROBE = "MERIDIAN-PROBE-7f3a"


def observation_template(engine: PolicyEngine) -> str:
    """What the chat template puts between the end of a model turn and the start of the
    next one when a user message carries tool output: ``{observation}`` marks the output.
    Derived from the model's own template, so it holds for any chat format."""
    tok = engine.tokenizer
    assert tok is not None
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
    after = [*history, {"role": "user", "content": tool_response(_PROBE + "-OBS")}]
    rendered = tok.apply_chat_template(after, add_generation_prompt=True, tokenize=False)
    tail = rendered[rendered.index(_PROBE) + len(_PROBE) :]
    return tail.replace(_PROBE + "-OBS", "{observation}")


def observation_ids(engine: PolicyEngine, template: str, text: str, model_ended_turn: bool) -> list[int]:
    """Tokens that close the model's turn, carry the tool output and open its next turn.

    The output is what code in the sandbox printed, so it is tokenized as plain text: a
    ``<|im_end|>`` it prints stays those characters. Tokenized with the template, it became
    the real end-of-turn token, and the output could close its own turn and open forged
    ones (an assistant's, a system's) in the policy's context."""
    tok = engine.tokenizer
    assert tok is not None
    before, _, after = template.partition("{observation}")
    eos = tok.eos_token or ""
    if model_ended_turn and eos and before.startswith(eos):
        before = before[len(eos) :]  # the model already closed its turn with the end token
    return [*template_ids(tok, before), *plain_ids(tok, text), *template_ids(tok, after)]


async def _model_turn(engine: PolicyEngine, ids: list[int], sampling: Sampling) -> tuple[list[int], list[float], list[int], str, str]:
    out_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    text, reason = "", ""
    async for delta in engine.generate(ids, sampling, PRIORITY_RL):
        out_ids += delta.token_ids
        logprobs += delta.logprobs
        versions += [delta.version] * len(delta.token_ids)
        text += delta.text
        reason = delta.finish_reason or reason
        if delta.all_versions is not None and len(delta.all_versions) == len(out_ids):
            versions = delta.all_versions  # the engine's own label of every token
    return out_ids, logprobs, versions, text, reason


async def _run_tool(sandboxes: sbx_grpc.EnvSandboxStub, sandbox_id: str, call: ToolCall) -> str:
    """Executes one tool call in the sandbox; failures become observations, not errors."""
    args = call.arguments
    try:
        if call.name == "bash":
            out = bytearray()
            code = 0
            request = sbx.ExecRequest(sandbox_id=sandbox_id, argv=["bash", "-c", args["command"]], timeout_seconds=TOOL_TIMEOUT_S)
            async for chunk in sandboxes.Exec(request, timeout=TOOL_TIMEOUT_S + SANDBOX_CALL_S):
                if chunk.HasField("result"):
                    code = chunk.result.exit_code if not chunk.result.timed_out else -1
                else:
                    out += chunk.stdout or chunk.stderr
            return f"{out.decode(errors='replace')}\n[exit code {code}]"
        if call.name == "write_file":
            files = [sbx.File(path=args["path"], content=args["content"].encode())]
            await sandboxes.WriteFiles(sbx.WriteFilesRequest(sandbox_id=sandbox_id, files=files), timeout=SANDBOX_CALL_S)
            return f"wrote {len(args['content'])} characters to {args['path']}"
        if call.name == "read_file":
            reply = await sandboxes.ReadFiles(sbx.ReadFilesRequest(sandbox_id=sandbox_id, paths=[args["path"]]), timeout=SANDBOX_CALL_S)
            return reply.files[0].content.decode(errors="replace")
    except grpc.aio.AioRpcError as exc:
        return f"error: {exc.details()}"
    return ""


#: Answers to the answer's write that the sandbox's own state explains (a folder or no
#: room where the answer goes): the policy's doing, so its tests run on what is there.
_POLICY_MADE = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})


async def _write_answer(sandboxes: sbx_grpc.EnvSandboxStub, sandbox_id: str, path: str, answer: bytes) -> None:
    """Writes a plain-text answer where the task's tests look for it. A write the policy
    made fail is logged and the episode scored without it: raised, it would fail the whole
    group, which is dropped, and a policy could escape the score of any task it fails."""
    try:
        await sandboxes.WriteFiles(sbx.WriteFilesRequest(sandbox_id=sandbox_id, files=[sbx.File(path=path, content=answer)]), timeout=SANDBOX_CALL_S)
    except grpc.aio.AioRpcError as exc:
        if exc.code() not in _POLICY_MADE:
            raise
        log.info("sandbox %s: the answer was not written to %s (%s: %s); the tests run without it", sandbox_id, path, exc.code().name, exc.details())


def tests_deadline(task: sbx.Task, limits: EpisodeLimits) -> float:
    """RunTests' client deadline: the task's tests may run for their whole wall limit (not
    the episode's, which bounds the policy's turns), plus a call's margin for envsandbox
    to settle the sandbox and start them. An envsandbox that does not say how long (0)
    gets the episode's budget."""
    if task.tests_wall_seconds > 0:
        return task.tests_wall_seconds + SANDBOX_CALL_S
    return max(limits.wall_s, SANDBOX_CALL_S)


@dataclasses.dataclass
class EpisodeResult:
    ledger: Ledger
    text: str
    finish_reason: str
    turns: int
    reward: float
    generate_s: float
    sandbox_s: float


async def run_episode(
    engine: PolicyEngine, sandboxes: sbx_grpc.EnvSandboxStub, sandbox_id: str, task: sbx.Task, prompt_ids: list[int], sampling: Sampling, limits: EpisodeLimits
) -> EpisodeResult:
    """The agent loop: model turn, tool call, observation, … until submit or a limit."""
    ledger = Ledger()
    template = observation_template(engine)
    deadline = time.monotonic() + limits.wall_s
    generate_s = sandbox_s = 0.0
    wrote_files = False
    last_text, reason, turns = "", "", 0
    turn_sampling = dataclasses.replace(sampling, stop=(*sampling.stop, TOOL_CALL_CLOSE), include_stop=True)
    while True:
        room = limits.max_model_len - len(prompt_ids) - len(ledger) - 1
        if turns >= limits.max_turns or room <= 0 or time.monotonic() > deadline:
            reason = "turn_limit" if turns >= limits.max_turns else "token_limit" if room <= 0 else "timeout"
            break
        t0 = time.perf_counter()
        turn = dataclasses.replace(turn_sampling, max_tokens=min(turn_sampling.max_tokens, room))
        ids, logprobs, versions, text, finish = await _model_turn(engine, prompt_ids + ledger.token_ids, turn)
        generate_s += time.perf_counter() - t0
        ledger.add_model(ids, logprobs, versions)
        turns += 1
        last_text, reason = text, finish
        call = parse_tool_call(text)
        if call is None or (isinstance(call, ToolCall) and call.name == "submit"):
            break
        t1 = time.perf_counter()
        if isinstance(call, str):
            observation = f"error: {call}"
        else:
            observation = await _run_tool(sandboxes, sandbox_id, call)
            wrote_files = wrote_files or call.name == "write_file"
        sandbox_s += time.perf_counter() - t1
        ended = bool(ids) and ids[-1] == engine.tokenizer.eos_token_id  # type: ignore[union-attr]
        ledger.add_observation(observation_ids(engine, template, format_observation(observation), ended))
    t2 = time.perf_counter()
    if not wrote_files and parse_tool_call(last_text) is None:
        await _write_answer(sandboxes, sandbox_id, task.answer_path, extract_answer(last_text).encode())
    result = await sandboxes.RunTests(sbx.RunTestsRequest(sandbox_id=sandbox_id), timeout=tests_deadline(task, limits))
    sandbox_s += time.perf_counter() - t2
    return EpisodeResult(ledger, last_text, reason, turns, result.reward, generate_s, sandbox_s)


async def run_group(
    engine: PolicyEngine,
    sandboxes: sbx_grpc.EnvSandboxStub,
    task: sbx.Task,
    group_size: int,
    sampling: Sampling,
    model: str,
    limits: EpisodeLimits = EpisodeLimits(),
    leases: LeaseKeeper | None = None,
    budget: SandboxBudget | None = None,
    sandbox_wait_s: float = 0.0,
) -> list[common_pb2.Trajectory]:
    """One GRPO group for ``task``: ``group_size`` episodes, each in a forked sandbox.
    With ``leases`` the sandboxes are leased and renewed while held, so a rollout killed
    mid-group leaves them to envsandbox for a lease, not their whole time-to-live. With
    ``budget`` the group first waits for its ``group_size + 1`` sandboxes there.

    The base's Create reserves the forks' room at envsandbox, so another client cannot
    take it before the Fork; with ``sandbox_wait_s`` it waits in envsandbox's line up to
    that long when envsandbox is full (other rollouts sharing it), instead of failing."""
    async with budget.hold(group_size + 1) if budget is not None else contextlib.nullcontext():
        prompt_ids = chat_prompt(engine, task)
        group_id = uuid.uuid4().hex
        leases = leases or LeaseKeeper(sandboxes, 0.0)
        create = sbx.CreateRequest(
            task_id=task.id, client_request_id=f"{group_id}-base", lease_seconds=leases.lease_s, fork_reserve=group_size, wait_seconds=sandbox_wait_s
        )
        base = await sandboxes.Create(create, timeout=sandbox_wait_s + SANDBOX_CALL_S)
        leases.hold([base.sandbox_id])
        # Forks no episode has closed yet. A group cancelled (a sibling group failed, the caller
        # went away) before its episodes start runs none of their cleanup: its forks are closed
        # here instead, or the lease keeper would renew them until their time-to-live.
        unclosed: set[str] = set()

        async def episode(index: int, sandbox_id: str) -> common_pb2.Trajectory:
            started = time.time()
            seed = None if sampling.seed is None else sampling.seed + index
            with tracer.start_as_current_span("rollout.episode") as span:
                span.set_attribute("meridian.task_id", task.id)
                span.set_attribute("meridian.group_id", group_id)
                try:
                    res = await run_episode(engine, sandboxes, sandbox_id, task, prompt_ids, dataclasses.replace(sampling, seed=seed), limits)
                finally:
                    unclosed.discard(sandbox_id)
                    try:
                        await sandboxes.Close(sbx.CloseRequest(sandbox_id=sandbox_id), timeout=SANDBOX_CALL_S)
                    finally:
                        leases.release([sandbox_id])
                span.set_attribute("meridian.reward", res.reward)
                span.set_attribute("meridian.turns", res.turns)
                return common_pb2.Trajectory(
                    trajectory_id=uuid.uuid4().hex,
                    task_id=task.id,
                    group_id=group_id,
                    group_size=group_size,
                    prompt_token_ids=prompt_ids,
                    completion_token_ids=res.ledger.token_ids,
                    logprobs=res.ledger.logprobs,
                    loss_mask=res.ledger.loss_mask,
                    policy_versions=res.ledger.policy_versions,
                    reward=res.reward,
                    truncated=res.finish_reason in ("length", "token_limit", "turn_limit", "timeout"),
                    finish_reason=res.finish_reason,
                    timings=common_pb2.Timings(generate_s=res.generate_s, sandbox_s=res.sandbox_s, total_s=time.time() - started, created_unix=started),
                    trace_context=telemetry.inject(span),
                    model=model,
                )

        try:
            try:
                forks = await sandboxes.Fork(sbx.ForkRequest(sandbox_id=base.sandbox_id, count=group_size), timeout=SANDBOX_CALL_S)
                unclosed.update(box.sandbox_id for box in forks.sandboxes)
                leases.hold(unclosed)
            finally:
                # The forks exist and are closed whatever happens; the base expires on
                # envsandbox's side if this fails (its lease, else its TTL).
                await _close(sandboxes, leases, base.sandbox_id)
            return await gather_or_cancel([episode(i, box.sandbox_id) for i, box in enumerate(forks.sandboxes)])
        finally:
            if unclosed:
                await asyncio.gather(*(_close(sandboxes, leases, sid) for sid in sorted(unclosed)))


async def _close(sandboxes: sbx_grpc.EnvSandboxStub, leases: LeaseKeeper, sandbox_id: str) -> None:
    """Closes a sandbox of the group and stops renewing it; a failure is logged, not
    raised (raised, it would skip the group's other closes), and the sandbox is left to
    its lease, else its time-to-live."""
    try:
        await sandboxes.Close(sbx.CloseRequest(sandbox_id=sandbox_id), timeout=SANDBOX_CALL_S)
    except grpc.aio.AioRpcError as exc:
        log.warning("closing sandbox %s failed (%s); it expires on its own", sandbox_id, exc.code().name)
    finally:
        leases.release([sandbox_id])


async def gather_or_cancel(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of ``coros`` run at once; when one fails, the others are cancelled
    (each closes its sandboxes on the way out) and awaited before its error is raised,
    so a failed group leaves no episode running behind it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def fetch_task(sandboxes: sbx_grpc.EnvSandboxStub, task_id: str) -> sbx.Task:
    try:
        return await sandboxes.GetTask(sbx.GetTaskRequest(task_id=task_id), timeout=SANDBOX_CALL_S)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            raise NotFound(f"no task {task_id!r} at envsandbox") from None
        raise
