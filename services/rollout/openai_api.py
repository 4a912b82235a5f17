"""An OpenAI-compatible HTTP front door on the rollout engine (``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``; streaming and not; ``n`` completions per request up
to a cap; function calling in the policy's own tool-call format, see
:mod:`services.rollout.openai_tools`), so existing agent scaffolds and the official
``openai`` client work unchanged. A request's traffic class (production, or RL that
production preempts) is that of its API key (:mod:`services.rollout.callers`)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from meridian import credentials
from meridian.errors import Unauthenticated
from services.rollout.agent import TOOL_CALL_CLOSE, tool_response
from services.rollout.callers import CallerClasses
from services.rollout.chat_template import ContentNotPlain, chat_ids
from services.rollout.config import DEFAULT_HTTP_MAX_BODY_BYTES, DEFAULT_MAX_PROMPT_BYTES
from services.rollout.engine import MAX_TEMPERATURE, Alternatives, PolicyEngine, Sampling
from services.rollout.openai_logprobs import alternative_texts, chat_logprobs, completion_logprobs, token_texts
from services.rollout.openai_tools import Tools, ToolsError, assistant_calls_text, held_back, parse_tools, split_calls, with_tools
from services.rollout.prompt_limits import is_text, text_bytes, tokenize_off_loop, too_long

log = logging.getLogger(__name__)

MAX_STOP = 16
#: Seeds are 63-bit (what every layer below carries as a signed 64-bit integer); choice i of
#: a seeded request takes seed + i, wrapped into the same range.
SEED_RANGE = 1 << 63


class RequestError(ValueError):
    """A request the API rejects with HTTP ``status`` (400) and an OpenAI-style error body."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContentTooLarge(RequestError):
    """A body or prompt past this server's bounds: HTTP 413, decided before the
    expensive part (reading the rest of the body, tokenising)."""

    status = 413


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise RequestError(f"'{key}' must be a number in [{lo}, {hi}], got {value!r}", key)
    return float(value)


def parse_n(body: dict[str, Any], max_n: int) -> int:
    """How many completions the request asks for (``n``, 1 when absent)."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_n:
        raise RequestError(f"'n' must be an integer in [1, {max_n}] on this server, got {n!r}", "n")
    return n


def choice_sampling(sampling: Sampling, index: int) -> Sampling:
    """Choice ``index``'s sampling: a given seed is offset per choice, so n seeded choices
    differ from each other and each is reproducible."""
    if sampling.seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % SEED_RANGE)


#: The status of an answer whose client left first (nginx's convention; nobody reads it).
CLIENT_CLOSED_REQUEST = 499


class ClientGone(Exception):
    """The HTTP client closed its connection before its answer was complete."""


async def client_gone(request: Request) -> None:
    """Returns once ``request``'s client has disconnected. Only for after the body was
    read: the server then has nothing more to deliver but the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merged(streams: list[AsyncIterator[Any]], until: Awaitable[None] | None = None) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, item) from several async iterators as items arrive; raises
    :class:`ClientGone` once ``until`` (:func:`client_gone`) returns. Every stream is
    closed when this ends, however it ends: the engine aborts what nobody will read."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None, False))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer below
            await queue.put((i, None, exc, True))
            return
        await queue.put((i, None, None, True))

    async def watch(until: Awaitable[None]) -> None:
        await until
        await queue.put((-1, None, ClientGone("the client disconnected"), True))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    if until is not None:
        tasks.append(asyncio.create_task(watch(until)))
    try:
        open_streams = len(streams)
        while open_streams:
            i, item, error, ended = await queue.get()
            if error is not None:
                raise error
            if ended:
                open_streams -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one engine delta of a choice adds: text, the finish reason on the last one,
    the sampled tokens, their log-probs and, when asked for, their alternatives."""

    text: str
    finish: str
    token_ids: list[int]
    logprobs: list[float]
    top: list[Alternatives] | None = None


@dataclasses.dataclass(frozen=True)
class Head:
    """What every chunk of an answer repeats, and how it is shaped."""

    rid: str
    created: int
    kind: str
    chat: bool
    logprobs: LogprobsAsk
    prompt_tokens: int
    tools: Tools | None = None  # offered to the model: its calls come back as tool_calls

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": self.prompt_tokens + completion_tokens}


class ToolCallStream:
    """One streamed chat choice with tools offered: content streams until a tool-call
    block begins (or may be beginning), and the calls go out whole with the last chunk."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of text already streamed as content

    def feed(self, text: str, last: bool) -> tuple[dict[str, Any], str]:
        """The delta for a piece of text, and on the last piece "tool_calls" when it made any."""
        self.text += text
        if not last:
            upto = held_back(self.text)
            delta = {"content": self.text[self.sent : upto]} if upto > self.sent else {}
            self.sent = max(self.sent, upto)
            return delta, ""
        content, calls = split_calls(self.text, self.tools)
        rest = content[self.sent :] if calls else self.text[self.sent :]
        closing: dict[str, Any] = {"content": rest} if rest else {}
        if not calls:
            return closing, ""
        closing["tool_calls"] = [{"index": k, **call.as_openai()} for k, call in enumerate(calls)]
        return closing, "tool_calls"


class UnknownModel(Exception):
    """The request names a model this server does not serve (404; not any LookupError,
    which would turn a KeyError of ours into a "wrong model" answer)."""


def lone_surrogate(body: Any) -> str:
    """Where a decoded JSON body holds a string with an unpaired surrogate ('' if
    nowhere): JSON's escapes allow one, no UTF-8 text (a tokenizer, a stop string) does."""
    stack: list[tuple[str, Any]] = [("request body", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if not is_text(value):
                return where
        elif isinstance(value, dict):
            stack.extend((f"{where}[{k!r}]", v) for k, v in value.items())
            stack.extend((f"a key of {where}", k) for k in value)
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
    return ""


#: Request fields this server does not implement, with the values that ask for nothing
#: (the first is named in the error). Any other value is refused: ignored, it would change
#: what the caller gets without telling them (no penalty applied, no JSON enforced, no
#: tool call parsed).
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "top_k": (-1, 0),
    "min_p": (0,),
}


def refuse_not_implemented(body: dict[str, Any]) -> None:
    """Raises a RequestError naming the first field of :data:`NOT_IMPLEMENTED` that asks
    for something (absent and null ask for nothing)."""
    for field, nothing in NOT_IMPLEMENTED.items():
        value = body.get(field)
        if value is not None and value not in nothing:
            raise RequestError(f"'{field}' is not supported by this server; leave it out or at {nothing[0]!r} rather than have it ignored, got {value!r}", field)


#: The most alternatives per token a request may ask for: the OpenAI API's own limits
#: (chat's ``top_logprobs``, a completion's ``logprobs``); vLLM computes up to 20.
MAX_TOP_LOGPROBS = {True: 20, False: 5}


@dataclasses.dataclass(frozen=True)
class LogprobsAsk:
    """What a request asks to see of the engine's log-probs."""

    sampled: bool = False  # each sampled token's log-prob (what an RL caller trains against)
    top: int = 0  # and this many most likely alternatives per token


def logprobs_asked(body: dict[str, Any], chat: bool) -> LogprobsAsk:
    """The log-probs a request asks for: chat's ``logprobs: true`` with ``top_logprobs``
    alternatives (which need ``logprobs: true``, as the OpenAI API has it), a
    completion's ``logprobs: k`` (the sampled tokens' log-probs and k alternatives)."""
    value, limit = body.get("logprobs"), MAX_TOP_LOGPROBS[chat]
    if chat:
        if not isinstance(value, (bool, type(None))):
            raise RequestError(f"'logprobs' must be true or false, got {value!r}", "logprobs")
        top = body.get("top_logprobs")
        top = 0 if top is None else top
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= limit:
            raise RequestError(f"'top_logprobs' must be an integer in [0, {limit}], got {top!r}", "top_logprobs")
        if top and value is not True:
            raise RequestError(f"'top_logprobs' ({top}) needs 'logprobs': true", "top_logprobs")
        return LogprobsAsk(value is True, top)
    if value is None:
        return LogprobsAsk()
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise RequestError(f"'logprobs' must be an integer in [0, {limit}] (alternatives per token), got {value!r}", "logprobs")
    return LogprobsAsk(True, value)


def offered_tools(body: dict[str, Any], chat: bool) -> Tools | None:
    """The functions a chat request offers the model (see :mod:`services.rollout.openai_tools`);
    a completion request has no messages to carry calls and results, so it offers none."""
    if chat:
        return parse_tools(body)
    if body.get("tools") not in (None, []) or body.get("tool_choice") not in (None, "none", "auto"):
        raise RequestError("'tools' and 'tool_choice' are for /v1/chat/completions (a completion has no messages to carry calls and results)", "tools")
    return None


def wants_usage_chunk(body: dict[str, Any]) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError("'stream_options' must be an object whose 'include_usage' is true or false", "stream_options")
    return bool(options.get("include_usage"))


def parse_sampling(body: dict[str, Any], max_model_len: int, default_max_tokens: int) -> Sampling:
    """Sampling parameters from an OpenAI request body, validated (``n`` apart: :func:`parse_n`)."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens < max_model_len:
        raise RequestError(f"'max_tokens' must be an integer in [1, {max_model_len - 1}], got {max_tokens!r}", "max_tokens")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_RANGE):
        raise RequestError(f"'seed' must be an integer in [0, 2**63), got {seed!r}", "seed")
    min_tokens = body.get("min_tokens") or 0
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_tokens:
        raise RequestError(f"'min_tokens' must be an integer in [0, max_tokens={max_tokens}], got {min_tokens!r}", "min_tokens")
    return Sampling(
        temperature=_number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        max_tokens=max_tokens,
        stop=tuple(stop),
        seed=seed,
        min_tokens=min_tokens,
    )


ROLES = ("system", "user", "assistant", "tool")


def message_text(message: Any, i: int) -> str:
    """What ``messages[i]`` says, validated: its ``content`` as a string, or as a list of
    text parts (``{"type": "text", "text": ...}``, joined by newlines as vLLM joins them),
    or none on an assistant message; an assistant's ``tool_calls`` follow as the blocks
    the model writes. Legacy ``function_call`` is refused rather than dropped."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(f"messages[{i}] needs a role ({', '.join(ROLES)})", "messages")
    if message.get("function_call"):
        # Dropped, the model would not see the calls it made in the history it is given.
        raise RequestError(f"messages[{i}] carries a legacy function_call, which this server does not render; send tool_calls", "messages")
    calls = message.get("tool_calls")
    if calls:
        if message["role"] != "assistant":
            raise RequestError(f"messages[{i}]: only an assistant message carries tool_calls", "messages")
        return _content_text(message, i) + assistant_calls_text(calls, i)
    return _content_text(message, i)


def _content_text(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message["role"] == "assistant":
        return ""
    if not isinstance(content, list):
        raise RequestError(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}", "messages")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a part of type {kind!r}" if isinstance(kind, str) else "not a text part"
            raise RequestError(f"messages[{i}].content[{j}] is {what}; this model takes text parts ({{'type': 'text', 'text': ...}}) only", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_prompt_ids(engine: PolicyEngine, messages: Any, tools: Tools | None = None) -> list[int]:
    """Token ids of a chat through the model's own template, what each message says kept
    as text (a ``<|im_start|>system`` in a user's words is those characters, not a new
    turn; see :mod:`services.rollout.chat_template`). ``tools`` are offered in a system
    message; a ``tool`` message is the user turn an episode's tool output is."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    texts = [message_text(m, i) for i, m in enumerate(messages)]  # checks each is an object with a role
    clean = [
        {"role": "user", "content": tool_response(text)} if m["role"] == "tool" else {"role": m["role"], "content": text}
        for m, text in zip(messages, texts)
    ]
    assert engine.tokenizer is not None
    try:
        return chat_ids(engine.tokenizer, with_tools(clean, tools))
    except ContentNotPlain as exc:
        raise RequestError(str(exc), "messages") from exc


def prompt_text_bytes(body: dict[str, Any], chat: bool) -> int:
    """Bytes of prompt text a request asks to tokenise (chat: every message's text;
    token-id prompts: 0, their length is bounded by the body and checked as tokens)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(_text_bytes_of(m, i) for i, m in enumerate(messages))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return text_bytes(prompt) if isinstance(prompt, str) else 0


def _text_bytes_of(message: Any, i: int) -> int:
    """A message's text bytes (0 for one :func:`message_text` refuses: its request is
    answered 400 before anything is tokenised)."""
    try:
        return text_bytes(message_text(message, i))
    except (RequestError, ToolsError):
        return 0


def completion_prompt_ids(engine: PolicyEngine, prompt: Any) -> list[int]:
    assert engine.tokenizer is not None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return list(engine.tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise RequestError("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def create_app(
    engine: PolicyEngine,
    model_name: str,
    max_model_len: int,
    default_max_tokens: int,
    callers: CallerClasses | None = None,
    max_n: int = 8,
    *,
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    max_body_bytes: int = DEFAULT_HTTP_MAX_BODY_BYTES,
) -> FastAPI:
    """The ASGI app; ``model_name`` is what ``/v1/models`` lists and responses echo;
    ``callers`` gives each API key its traffic class (default: everyone production).
    A body over ``max_body_bytes`` or prompt text over ``max_prompt_bytes`` answers 413
    before it is read whole or tokenised."""
    # No generated docs routes: every route answers only callers with a key.
    app = FastAPI(title="Meridian rollout (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
    callers = callers or CallerClasses({})

    def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": None}})

    async def read_body(request: Request) -> bytes:
        """The body, refused (413) as soon as it is known to be too large: from its
        declared length before reading anything, or while it streams in."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise ContentTooLarge(f"request body is {int(declared)} bytes, more than this server takes (http_max_body_bytes={max_body_bytes})")
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > max_body_bytes:
                raise ContentTooLarge(f"request body is over {max_body_bytes} bytes, more than this server takes (http_max_body_bytes={max_body_bytes})")
            parts.append(part)
        return b"".join(parts)

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await read_body(request)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("request body is not valid JSON") from None
        except RecursionError:
            raise RequestError("request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        if where := lone_surrogate(body):
            raise RequestError(f"{where} holds an unpaired surrogate escape (\\ud800-style): not text")
        if body.get("model") not in (None, model_name):
            raise UnknownModel(f"model {body.get('model')!r} is not served here (serving {model_name!r})")
        return body

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not the caller's error: logged with a reference the caller can quote, and
        # answered in the API's own error shape, as gRPC's error boundary answers INTERNAL.
        ref = uuid.uuid4().hex[:12]
        log.error("unhandled error in the OpenAI-compatible API (ref=%s)", ref, exc_info=exc)
        return error(500, f"internal error (ref={ref}); see the service log", "server_error")

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, exc: RequestError) -> JSONResponse:
        return error(exc.status, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(ToolsError)
    async def bad_tools(_: Request, exc: ToolsError) -> JSONResponse:
        return error(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(Unauthenticated)
    async def unauthenticated(_: Request, exc: Unauthenticated) -> JSONResponse:
        return error(401, str(exc), "authentication_error")

    @app.exception_handler(UnknownModel)
    async def not_found(_: Request, exc: UnknownModel) -> JSONResponse:
        return error(404, str(exc), "not_found_error", "model")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        callers.classify(request.headers.get("authorization"))  # a key, when keys are on
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "meridian"}]}

    async def run(ids: list[int], sampling: Sampling, priority: int) -> AsyncIterator[Piece]:
        async for delta in engine.generate(ids, sampling, priority):
            yield Piece(delta.text, delta.finish_reason if delta.finished else "", delta.token_ids, delta.logprobs, delta.top_logprobs)

    def logprobs_of(piece: Piece, offset: int, head: Head) -> dict[str, Any] | None:
        """The ``logprobs`` object of a choice, or of a chunk of one whose text so far is
        ``offset`` characters long (completions count token offsets in the choice's text);
        None when the request did not ask for log-probs."""
        if not head.logprobs.sampled:
            return None
        texts = token_texts(engine.tokenizer, piece.token_ids)
        top = alternative_texts(engine.tokenizer, piece.top or []) if head.logprobs.top else None
        return chat_logprobs(texts, piece.logprobs, top) if head.chat else completion_logprobs(texts, piece.logprobs, offset, top)

    async def respond(request: Request, chat: bool) -> Any:
        priority = callers.classify(request.headers.get("authorization"))
        body = await body_of(request)
        refuse_not_implemented(body)
        logprobs = logprobs_asked(body, chat)
        usage_chunk = wants_usage_chunk(body)
        tools = offered_tools(body, chat)
        size = prompt_text_bytes(body, chat) + (text_bytes(tools.prompt()) if tools else 0)
        if problem := too_long(size, max_prompt_bytes):
            raise ContentTooLarge(problem, "messages" if chat else "prompt")
        if chat:
            ids = await tokenize_off_loop(size, chat_prompt_ids, engine, body.get("messages"), tools)
        else:
            ids = await tokenize_off_loop(size, completion_prompt_ids, engine, body.get("prompt"))
        if problem := engine.prompt_problem(ids):
            raise RequestError(problem, "prompt")
        sampling = dataclasses.replace(parse_sampling(body, max_model_len, default_max_tokens), top_logprobs=logprobs.top)
        if tools:
            # A call ends the model's turn, as in the episodes it was trained on.
            sampling = dataclasses.replace(sampling, stop=(*sampling.stop, TOOL_CALL_CLOSE))
        n = parse_n(body, max_n)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        # The n choices run at once on the engine (they share the prompt's cached prefix).
        streams = [run(ids, choice_sampling(sampling, i), priority) for i in range(n)]
        head = Head(rid, created, kind, chat, logprobs, len(ids), tools)
        if body.get("stream"):
            # A stream's client leaving ends the response (Starlette watches for it), and
            # with it merged(): the engine's requests are aborted.
            return StreamingResponse(_stream(head, streams, usage_chunk), media_type="text/event-stream")
        texts, reasons = [""] * n, [""] * n
        token_ids: list[list[int]] = [[] for _ in range(n)]
        token_logprobs: list[list[float]] = [[] for _ in range(n)]
        token_top: list[list[Alternatives]] = [[] for _ in range(n)]
        # Nothing else notices a non-streaming client leaving: the engine would generate
        # up to max_tokens for nobody, holding capacity production traffic needs.
        try:
            async for i, piece in merged(streams, client_gone(request)):
                texts[i] += piece.text
                reasons[i] = piece.finish or reasons[i]
                token_ids[i] += piece.token_ids
                token_logprobs[i] += piece.logprobs
                token_top[i] += piece.top or []
        except ClientGone:
            # The engine's requests were aborted; nobody is there to read an answer.
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = []
        for i in range(n):
            choice: dict[str, Any] = {"index": i, "finish_reason": reasons[i] or "stop"}
            choice["logprobs"] = logprobs_of(Piece(texts[i], reasons[i], token_ids[i], token_logprobs[i], token_top[i]), 0, head)
            if chat:
                choice["message"] = {"role": "assistant", "content": texts[i]}
                if tools and (found := split_calls(texts[i], tools))[1]:
                    content, calls = found
                    choice["message"] = {"role": "assistant", "content": content.strip() or None, "tool_calls": [c.as_openai() for c in calls]}
                    choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = texts[i]
            choices.append(choice)
        return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices, "usage": head.usage(sum(map(len, token_ids)))}

    async def _stream(head: Head, streams: list[AsyncIterator[Piece]], usage_chunk: bool) -> AsyncIterator[bytes]:
        def event(choices: list[dict[str, Any]], **more: Any) -> bytes:
            chunk = {"id": head.rid, "object": head.kind + (".chunk" if head.chat else ""), "created": head.created, "model": model_name, "choices": choices, **more}
            return f"data: {json.dumps(chunk)}\n\n".encode()

        if head.chat:
            for i in range(len(streams)):
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        offsets = [0] * len(streams)
        calls = [ToolCallStream(head.tools) if head.tools else None for _ in streams]
        tokens = 0
        async for i, piece in merged(streams):
            tokens += len(piece.token_ids)
            choice: dict[str, Any] = {"index": i, "finish_reason": piece.finish or None}
            choice["logprobs"] = logprobs_of(piece, offsets[i], head)
            if head.chat:
                if (watch := calls[i]) is not None:
                    choice["delta"], finish = watch.feed(piece.text, bool(piece.finish))
                    choice["finish_reason"] = finish or choice["finish_reason"]
                else:
                    choice["delta"] = {"content": piece.text} if piece.text else {}
            else:
                choice["text"] = piece.text
                if choice["logprobs"] is not None:
                    offsets[i] += sum(map(len, choice["logprobs"]["tokens"]))
            yield event([choice])
        if usage_chunk:
            yield event([], usage=head.usage(tokens))
        yield b"data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await respond(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await respond(request, chat=False)

    return app


def http_tls(host: str, identity: credentials.Identity | None) -> tuple[Path, Path] | None:
    """Certificate and key the HTTP API serves with: none on loopback (the API key is
    still required), rollout's server certificate elsewhere; plaintext on a non-loopback
    address without credentials is refused."""
    if credentials.is_loopback(host):
        return None
    if identity is None:
        raise ValueError(f"the OpenAI API will not serve plaintext on {host}: only loopback addresses may go without TLS; serve with credentials")
    return credentials.cert_path(identity.folder, "rollout")


class HttpFrontDoor:
    """uvicorn serving the app on the already running event loop.

    Started piecewise (startup, then its tick loop as a task) rather than through
    ``Server.serve``, which would take over SIGTERM from the gRPC runtime that owns
    the ordered shutdown.
    """

    def __init__(self, app: Any, host: str, port: int, tls: tuple[Path, Path] | None = None, max_concurrency: int = 256) -> None:
        import uvicorn

        files = {"ssl_certfile": str(tls[0]), "ssl_keyfile": str(tls[1])} if tls else {}
        # limit_concurrency: past it uvicorn answers 503 at once, so requests (each may
        # buffer a body of up to http_max_body_bytes) cannot pile up without bound.
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", limit_concurrency=max_concurrency, **files)
        self._server = uvicorn.Server(config)
        self._ticks: Any = None
        self.port = 0

    async def start(self) -> int:
        import asyncio

        config = self._server.config
        if not config.loaded:
            config.load()
        self._server.lifespan = config.lifespan_class(config)
        await self._server.startup()
        if not self._server.started:
            raise RuntimeError("the HTTP API could not start listening")
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])
        self._ticks = asyncio.create_task(self._server.main_loop())
        return self.port

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._ticks is not None:
            await self._ticks
        if self._server.started:
            await self._server.shutdown()
