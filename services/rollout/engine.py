"""The inference engine: one vLLM AsyncLLM per rollout process, with generation that
records the policy version of every token and in-place weight updates that let
requests in flight finish on the weights they started with."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from services.weightsync.tensors import RawTensor, to_torch

PRIORITY_PRODUCTION = 0
PRIORITY_RL = 1


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclasses.dataclass
class Delta:
    """Tokens generated since the previous delta of one request."""

    token_ids: list[int]
    logprobs: list[float]
    version: int
    text: str
    finished: bool
    finish_reason: str


class VersionGate:
    """Requests hold the gate while they generate; a weight update waits for them to
    finish on the old weights and holds new requests back until it is applied."""

    def __init__(self) -> None:
        self._active = 0
        self._updating = False
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._updating)
            self._active += 1
        try:
            yield
        finally:
            async with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def update(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._updating)
            self._updating = True
            await self._cond.wait_for(lambda: self._active == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._updating = False
                self._cond.notify_all()


class Engine:
    """vLLM behind a small async API; ``version`` is the policy version being served."""

    def __init__(self, model_dir: Path, max_model_len: int, kv_cache_gib: float, seed: int) -> None:
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.seed = seed
        self.version = 0
        self.gate = VersionGate()
        self._llm = None
        self.tokenizer = None

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
        self._llm = AsyncLLM.from_engine_args(args)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    @property
    def vocab_size(self) -> int:
        assert self.tokenizer is not None
        return len(self.tokenizer)

    async def generate(self, prompt_ids: list[int], sampling: Sampling, priority: int, request_id: str = "") -> AsyncIterator[Delta]:
        """Streams the completion of ``prompt_ids``; every token carries this engine's version."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        assert self._llm is not None, "engine not started"
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            seed=sampling.seed,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
        )
        request_id = request_id or uuid.uuid4().hex
        async with self.gate.request():
            version = self.version
            async for out in self._llm.generate({"prompt_token_ids": prompt_ids}, params, request_id=request_id, priority=priority):
                completion = out.outputs[0]
                ids = list(completion.token_ids)
                logprobs = [entry[tok].logprob for tok, entry in zip(ids, completion.logprobs or [])]
                yield Delta(ids, logprobs, version, completion.text, out.finished, completion.finish_reason or "")

    async def apply_weights(self, weights: dict[str, RawTensor], version: int) -> None:
        """Loads ``weights`` in place between requests, resets the prefix cache, then serves ``version``."""
        from safetensors.torch import save_file

        assert self._llm is not None, "engine not started"
        # Shared memory keeps the hand-over to the worker process off the disk.
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.NamedTemporaryFile(dir=folder, prefix="meridian-weights-", suffix=".safetensors") as fh:
            await asyncio.to_thread(save_file, {n: to_torch(t) for n, t in weights.items()}, fh.name)
            async with self.gate.update():
                await self._llm.collective_rpc("meridian_reload_weights", args=(fh.name,))
                # Cached KV blocks were computed by the old weights.
                await self._llm.reset_prefix_cache()
                self.version = version
