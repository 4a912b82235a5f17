"""The inference engine: one vLLM AsyncLLM per rollout process, with generation that
records the policy version of every token, and the primitives a weight update needs
(a front gate, pause and resume, version labels, scoring past the gate); the update
procedure itself is :mod:`services.rollout.weight_updates`."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from meridian.errors import InvalidArgument
from services.rollout import engine_ipc
from services.rollout.admission import AdmissionConfig, RlScheduler, RlTicket

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: How requests in flight meet a weight update: "finish" lets them complete on the old
#: weights (new ones wait); "pause" freezes them and continues them on the new weights.
UPDATE_POLICIES = ("finish", "pause")

#: VLLM_RPC_BASE_PATH as the user set it (None: each engine makes a folder of its own).
_USER_RPC_PATH = os.environ.get("VLLM_RPC_BASE_PATH")

#: A CPU list as vLLM's VLLM_CPU_OMP_THREADS_BIND takes one: ids and ranges, comma-separated.
_CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def check_engine_cpus(cpus: str) -> str:
    """``cpus`` if it is a valid ``--engine-cpus`` value ('auto', 'none', or a CPU list
    such as '0-3,8'); ValueError naming it otherwise (here, not when vLLM's worker starts)."""
    if cpus in ("auto", "none"):
        return cpus
    if _CPU_LIST.fullmatch(cpus) and all(int(lo) <= int(hi) for lo, _, hi in (r.partition("-") for r in cpus.split(",")) if hi):
        return cpus
    raise ValueError(f"engine_cpus must be 'auto', 'none' or a CPU list such as '0-3,8', got {cpus!r}")


def cpu_binding_env(cpus: str) -> dict[str, str]:
    """The environment that gives vLLM's CPU worker the binding ``cpus`` asks for (empty
    for 'auto': vLLM's own, or what the user exported).

    vLLM's CPU backend binds its worker's OpenMP threads, the worker's main thread among
    them, to the cores of one NUMA node less one it keeps for the scheduler (core 0 alone
    on a two-core host), the same cores for every engine on a host: engines sharing a
    host need lists of their own to stay apart. Unbound, a worker runs one OpenMP thread
    per core the process may use, whatever else runs there."""
    check_engine_cpus(cpus)
    if cpus == "auto":
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind" if cpus == "none" else cpus}


PRIORITY_PRODUCTION = 0
PRIORITY_RL = 1

#: Per-token version of tokens sampled by weights that were then rejected and rolled back.
REJECTED_VERSION = -2
_CANDIDATE = "candidate:"
#: The highest sampling temperature either front door takes (OpenAI's bound; vLLM refuses
#: a NaN or an infinity with an error of its own).
MAX_TEMPERATURE = 2.0


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int | None = None
    include_stop: bool = False  # keep a matched stop string in the output (tool-call close tags)
    min_tokens: int = 0
    top_logprobs: int = 0  # the most likely alternatives reported per sampled token (0: none)


#: One sampled token's most likely alternatives: (token id, log-prob), most likely first.
Alternatives = list[tuple[int, float]]


@dataclasses.dataclass
class Delta:
    """Tokens generated since the previous delta of one request.

    ``version`` is the version being served when the delta arrived. The last delta of a
    request also carries ``all_versions``: the version of every token of the whole
    completion as the engine labelled it at the step that sampled it, which stays exact
    when an update lands in the middle of a request (the ``pause`` policy)."""

    token_ids: list[int]
    logprobs: list[float]
    version: int
    text: str
    finished: bool
    finish_reason: str
    all_versions: list[int] | None = None
    top_logprobs: list[Alternatives] | None = None  # per token, when the sampling asked for them


def alternatives(entry: Any, k: int) -> Alternatives:
    """The ``k`` most likely tokens of one position of vLLM's log-probs, most likely first.
    vLLM reports the sampled token beside them, by its own rank, which may be below ``k``."""
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in entry.items() if lp.rank is not None and lp.rank <= k)
    return [(token, logprob) for _, token, logprob in ranked]


@runtime_checkable
class PolicyEngine(Protocol):
    """What episodes and the OpenAI-compatible front door need from an engine: the
    policy version being served, its tokenizer, prompt validation, generation that
    labels every token with its version, and scoring. :class:`Engine` is the vLLM one;
    the weight-update primitives stay on it, as only the update procedure uses them."""

    version: int
    tokenizer: PreTrainedTokenizerBase | None  # None until the engine has started

    def prompt_problem(self, ids: Sequence[int]) -> str: ...

    def generate(self, prompt_ids: list[int], sampling: Sampling, priority: int, request_id: str = "") -> AsyncIterator[Delta]: ...

    async def score(self, token_ids: list[int], priority: int = PRIORITY_PRODUCTION) -> list[float]: ...


@contextlib.contextmanager
def engine_environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set only while vLLM starts its processes (which read it then), restored
    after: left in the environment, an engine's socket folder would send later engines and
    child processes to a removed folder, and its binding would bind them too."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Engine:
    """vLLM behind a small async API; ``version`` is the policy version being served."""

    def __init__(
        self, model_dir: Path, max_model_len: int, kv_cache_gib: float, seed: int, update_policy: str = "finish", admission: AdmissionConfig | None = None,
        cpus: str = "auto",
    ) -> None:
        if update_policy not in UPDATE_POLICIES:
            raise InvalidArgument(f"update policy must be one of {UPDATE_POLICIES}, got {update_policy!r}")
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.seed = seed
        self.update_policy = update_policy
        self.cpus = check_engine_cpus(cpus)
        self.version = 0
        self._llm = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self._ipc: engine_ipc.IpcDir | None = None  # this engine's folder for vLLM's socket files (see start)
        self.update_lock = asyncio.Lock()
        self.scheduler = RlScheduler(admission or AdmissionConfig())
        self.tokens_generated = {PRIORITY_PRODUCTION: 0, PRIORITY_RL: 0}
        self.rl_resumed = 0
        self._aborts: set[asyncio.Task[None]] = set()  # preemptions on their way to the engine
        # Closed while a weight update is applied and verified: new requests wait here.
        self._open = asyncio.Event()
        self._open.set()
        # Version labels the engine attached to tokens while a candidate was on trial.
        self._trials: dict[str, int] = {}

    async def start(self) -> None:
        # vLLM reads these at import and engine start; the CPU KV cache is sized in GiB here.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(self.kv_cache_gib))))
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(self.model_dir),
            dtype="bfloat16",
            max_model_len=self.max_model_len,
            enforce_eager=True,
            enable_prefix_caching=True,
            disable_log_stats=True,
            seed=self.seed,
            scheduling_policy="priority",
            worker_extension_cls="services.rollout.vllm_worker.WeightUpdateExtension",
        )
        env = cpu_binding_env(self.cpus)
        # vLLM binds its processes' sockets as files in VLLM_RPC_BASE_PATH (the temp folder
        # by default) and never removes them: thousands were left after a day of tests. This
        # engine gets a folder of its own, removed at shutdown or, if it is killed, by the
        # next engine to start (see engine_ipc; a user's setting is kept).
        if _USER_RPC_PATH is None:
            self._ipc = engine_ipc.create()
            env["VLLM_RPC_BASE_PATH"] = self._ipc.path
        with engine_environment(env):
            self._llm = AsyncLLM.from_engine_args(args)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        await self._llm.update_weight_version(str(self.version))

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._ipc is not None:
            self._ipc.remove()
            self._ipc = None

    @property
    def ipc_dir(self) -> str:
        """This engine's folder for vLLM's socket files ('' when it has none)."""
        return self._ipc.path if self._ipc is not None else ""

    @property
    def vocab_size(self) -> int:
        assert self.tokenizer is not None
        return len(self.tokenizer)

    def prompt_problem(self, ids: Sequence[int]) -> str:
        """Why the engine cannot take ``ids`` as a prompt ('' when it can); both front doors
        ask. The length first: a caller's 64 MiB of ids is refused before any pass over them."""
        if len(ids) >= self.max_model_len:
            return f"prompt is {len(ids)} tokens; the model takes at most {self.max_model_len - 1}"
        vocab = self.vocab_size  # once: the tokenizer's length is not a cheap call
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            return f"token ids outside the vocabulary (size {vocab}): {bad[:5]}"
        return ""

    async def generate(self, prompt_ids: list[int], sampling: Sampling, priority: int, request_id: str = "") -> AsyncIterator[Delta]:
        """Streams the completion of ``prompt_ids``; each delta carries the policy version
        that produced its tokens (the version changes only while the engine is paused, so
        a delta never mixes versions). RL requests are admitted by the scheduler and may
        be preempted and resumed on the way (invisible here but for the wait)."""
        assert self._llm is not None, "engine not started"
        request_id = request_id or uuid.uuid4().hex
        stream = self._production(prompt_ids, sampling, request_id) if priority == PRIORITY_PRODUCTION else self._rl(prompt_ids, sampling, request_id)
        async for delta in stream:
            self.tokens_generated[priority] += len(delta.token_ids)
            yield delta

    def _params(self, sampling: Sampling):  # type: ignore[no-untyped-def]
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            seed=sampling.seed,
            include_stop_str_in_output=sampling.include_stop,
            min_tokens=sampling.min_tokens,
            logprobs=sampling.top_logprobs,
            output_kind=RequestOutputKind.DELTA,
        )

    async def _segment(self, prompt_ids: list[int], sampling: Sampling, request_id: str, priority: int) -> AsyncIterator[tuple[Delta, list[int] | None]]:
        """One vLLM request: (delta, None) per output, and on the last one (delta, the
        version of every token of this request as the engine labelled it)."""
        async for out in self.llm.generate({"prompt_token_ids": prompt_ids}, self._params(sampling), request_id=request_id, priority=priority):
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            entries = completion.logprobs or []
            logprobs = [entry[tok].logprob for tok, entry in zip(ids, entries)]
            top = [alternatives(entry, sampling.top_logprobs) for entry in entries] if sampling.top_logprobs else None
            versions = self._token_versions(completion.weight_versions) if out.finished else None
            yield Delta(ids, logprobs, self.version, completion.text, out.finished, completion.finish_reason or "", top_logprobs=top), versions

    async def _production(self, prompt_ids: list[int], sampling: Sampling, request_id: str) -> AsyncIterator[Delta]:
        async with self.scheduler.production() as latency:
            await self._open.wait()
            async for delta, versions in self._segment(prompt_ids, sampling, request_id, PRIORITY_PRODUCTION):
                latency.tokens(len(delta.token_ids))
                delta.all_versions = versions
                yield delta

    async def _rl(self, prompt_ids: list[int], sampling: Sampling, request_id: str) -> AsyncIterator[Delta]:
        """An RL request as segments: a preempted segment is aborted at a token boundary
        and the next one continues from the prompt plus every token so far (the prefix
        cache makes the re-prefill cheap), so the completion is the tokens of all
        segments in order, each with the log-prob and the version it was sampled with.

        A stop string split across two segments is not seen by vLLM (each segment checks
        only its own text): the completion then runs on past it."""
        done_ids: list[int] = []
        done_versions: list[int] = []
        segment = 0
        while True:
            ticket = await self.scheduler.admit_rl()
            try:
                await self._open.wait()
                done = len(done_ids)
                if done >= sampling.max_tokens:  # preempted just as its last token arrived
                    yield Delta([], [], self.version, "", True, "length", done_versions)
                    return
                rest = dataclasses.replace(sampling, max_tokens=sampling.max_tokens - done, min_tokens=max(0, sampling.min_tokens - done))
                finished = False
                async for delta, versions in self._rl_segment(prompt_ids + done_ids, rest, f"{request_id}#{segment}", ticket):
                    done_ids.extend(delta.token_ids)
                    if versions is not None and not delta.finished:
                        done_versions.extend(versions)  # the preempted segment's tokens
                    if delta.finished:
                        delta.all_versions = done_versions + (versions or [])
                        finished = True
                    if delta.token_ids or delta.finished:
                        yield delta
                if finished:
                    return
            finally:
                self.scheduler.release(ticket)
            segment += 1
            self.rl_resumed += 1

    async def _rl_segment(self, prompt_ids: list[int], sampling: Sampling, request_id: str, ticket: RlTicket) -> AsyncIterator[tuple[Delta, list[int] | None]]:
        """One segment; its last delta comes back unfinished (with the segment's versions)
        when the ticket was preempted."""
        if ticket.preempted:
            return
        ticket.on_preempt(lambda: self._abort_soon(request_id))
        async for delta, versions in self._segment(prompt_ids, sampling, request_id, PRIORITY_RL):
            if delta.finished and delta.finish_reason == "abort" and ticket.preempted:
                delta.finished, delta.finish_reason = False, ""
            yield delta, versions

    def _abort_soon(self, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.llm.abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def _token_versions(self, spans: list | None) -> list[int] | None:  # type: ignore[type-arg]
        """Per-token versions of a finished completion from the engine's version spans."""
        if spans is None:
            return None
        return [self.label_version(span.version) for span in spans for _ in range(span.start, span.end)]

    def label_version(self, label: str) -> int:
        """The policy version behind an engine label: a committed candidate is its
        version, a rejected one :data:`REJECTED_VERSION`."""
        if label.startswith(_CANDIDATE):
            return self._trials.get(label, REJECTED_VERSION)
        return int(label) if label.lstrip("-").isdigit() else 0

    async def score(self, token_ids: list[int], priority: int = PRIORITY_PRODUCTION) -> list[float]:
        """Log-prob of each token of ``token_ids`` given the ones before it (the first gets 0).
        An RL-class caller's prefill is admitted like its generations (see admission.py)."""
        if priority != PRIORITY_RL:
            await self._open.wait()
            return await self.score_now(token_ids)
        ticket = await self.scheduler.admit_rl()
        try:
            await self._open.wait()
            return await self.score_now(token_ids, PRIORITY_RL)
        finally:
            self.scheduler.release(ticket)

    async def score_now(self, token_ids: list[int], priority: int = PRIORITY_PRODUCTION) -> list[float]:
        """:meth:`score` past the update gate and admission: for the canary of a version on trial."""
        from vllm import SamplingParams

        assert self._llm is not None, "engine not started"
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
        final = None
        async for out in self._llm.generate({"prompt_token_ids": token_ids}, params, request_id=uuid.uuid4().hex, priority=priority):
            final = out
        assert final is not None and final.prompt_logprobs is not None
        return [0.0 if entry is None else entry[tok].logprob for tok, entry in zip(token_ids, final.prompt_logprobs)]

    # ------------------------------------------------------------ update primitives

    @property
    def llm(self):  # type: ignore[no-untyped-def]
        """The vLLM AsyncLLM (for the update procedure's worker calls)."""
        assert self._llm is not None, "engine not started"
        return self._llm

    def close_gate(self) -> None:
        """New requests wait until :meth:`open_gate` (requests in flight are not affected)."""
        self._open.clear()

    def open_gate(self) -> None:
        self._open.set()

    async def pause(self) -> None:
        """Stops the engine between steps: requests in flight finish first under the
        ``finish`` policy, and freeze where they are under ``pause``."""
        await self.llm.pause_generation(mode="wait" if self.update_policy == "finish" else "keep", clear_cache=False)

    async def freeze(self) -> None:
        """Stops the engine between steps at once, freezing requests in flight."""
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def label_trial(self, version: int) -> None:
        """Tokens sampled from now on are labelled as coming from candidate ``version``."""
        await self.llm.update_weight_version(f"{_CANDIDATE}{version}")

    async def settle_trial(self, version: int, accepted: bool) -> None:
        """Ends a trial: the candidate becomes the served version, or is marked rejected
        (tokens it sampled then carry :data:`REJECTED_VERSION`)."""
        self._trials[f"{_CANDIDATE}{version}"] = version if accepted else REJECTED_VERSION
        if accepted:
            self.version = version
        await self.llm.update_weight_version(str(self.version))
