"""The OpenAI API's request fields beyond the prompt: the sampled tokens' log-probs (what
an RL caller trains against) and their most likely alternatives, a stream's usage chunk,
and fields this server does not implement, refused by name rather than ignored."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.unit.test_rollout_chat_template import OTHER_TOKENS, RecordingEngine, tok  # noqa: F401 - tok: a fixture

TOKENS, LOGPROBS = [",", " Fire", ","], [-0.5, -1.25, -0.125]


@pytest.fixture
def engine(tok: Any) -> RecordingEngine:  # noqa: F811 - the imported fixture
    return RecordingEngine(tok)


@pytest.fixture
def http(engine: RecordingEngine) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from services.rollout.callers import CallerClasses
    from services.rollout.openai_api import create_app

    with TestClient(create_app(engine, "m", 2048, 64, CallerClasses({}, "production"))) as client:  # type: ignore[arg-type]
        yield client


def _alternatives(tok: Any, k: int) -> list[list[tuple[str, float]]]:  # noqa: F811 - the imported fixture
    """What RecordingEngine's alternatives say, as text: the sampled token, then OTHER_TOKENS."""
    others = [tok.decode([o]) for o in OTHER_TOKENS]
    return [[(t, lp), *((o, lp - 1 - j) for j, o in enumerate(others))][:k] for t, lp in zip(TOKENS, LOGPROBS)]


def _post(http: Any, chat: bool, **fields: Any) -> Any:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    return http.post("/v1/chat/completions" if chat else "/v1/completions", json={**prompt, "max_tokens": 3, **fields})


def _events(reply: Any) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", reply.text
    return [json.loads(line) for line in lines[:-1]]


def test_chat_logprobs_are_the_sampled_tokens(http: Any) -> None:
    (choice,) = _post(http, True, logprobs=True, top_logprobs=0).json()["choices"]
    content = choice["logprobs"]["content"]
    assert [(c["token"], c["logprob"], c["top_logprobs"]) for c in content] == [(t, lp, []) for t, lp in zip(TOKENS, LOGPROBS)]
    assert [bytes(c["bytes"]).decode() for c in content] == TOKENS and choice["message"]["content"] == "".join(TOKENS)
    assert _post(http, True).json()["choices"][0]["logprobs"] is None
    assert _post(http, True, logprobs=False).json()["choices"][0]["logprobs"] is None


def test_completion_logprobs_carry_offsets_in_the_choices_text(http: Any) -> None:
    (choice,) = _post(http, False, logprobs=0).json()["choices"]
    assert choice["logprobs"] == {"tokens": TOKENS, "token_logprobs": LOGPROBS, "top_logprobs": None, "text_offset": [0, 1, 6]}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_are_the_engines_alternatives_as_text(http: Any, engine: RecordingEngine, tok: Any, stream: bool) -> None:  # noqa: F811
    reply = _post(http, True, logprobs=True, top_logprobs=2, stream=stream)
    if stream:
        content = [c for chunk in _events(reply) if (lp := chunk["choices"][0]["logprobs"]) for c in lp["content"]]
    else:
        content = reply.json()["choices"][0]["logprobs"]["content"]
    assert engine.samplings[-1].top_logprobs == 2
    assert [[(a["token"], a["logprob"]) for a in c["top_logprobs"]] for c in content] == _alternatives(tok, 2)
    assert all(bytes(a["bytes"]).decode() == a["token"] for c in content for a in c["top_logprobs"])
    assert [(c["token"], c["logprob"]) for c in content] == list(zip(TOKENS, LOGPROBS))


@pytest.mark.parametrize("stream", [False, True])
def test_a_completions_logprobs_above_0_are_alternatives_per_token(http: Any, engine: RecordingEngine, tok: Any, stream: bool) -> None:  # noqa: F811
    reply = _post(http, False, logprobs=3, stream=stream)
    if stream:
        maps = [m for chunk in _events(reply) if (lp := chunk["choices"][0]["logprobs"]) for m in lp["top_logprobs"]]
    else:
        maps = reply.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert engine.samplings[-1].top_logprobs == 3
    assert maps == [dict(alts) for alts in _alternatives(tok, 3)]


def test_alternatives_with_the_same_text_keep_the_more_likely() -> None:
    from services.rollout.openai_logprobs import completion_logprobs

    got = completion_logprobs(["a"], [-0.5], 0, [[("a", -0.5), ("b", -1.0), ("a", -2.0)]])
    assert got["top_logprobs"] == [{"a": -0.5, "b": -1.0}]


def test_a_token_the_engine_gave_no_alternatives_keeps_its_place() -> None:
    from services.rollout.openai_logprobs import chat_logprobs, completion_logprobs

    chat = chat_logprobs(["a", "b"], [-0.5, -1.0], [[("a", -0.5)]])
    assert [(c["token"], len(c["top_logprobs"])) for c in chat["content"]] == [("a", 1), ("b", 0)]
    assert completion_logprobs(["a", "b"], [-0.5, -1.0], 0, [[("a", -0.5)]])["top_logprobs"] == [{"a": -0.5}, {}]


@pytest.mark.parametrize("chat", [True, False])
def test_a_streams_logprobs_add_up_to_the_whole_answers_and_it_ends_with_usage(http: Any, chat: bool) -> None:
    logprobs = {"logprobs": True} if chat else {"logprobs": 0}
    reply = _post(http, chat, stream=True, stream_options={"include_usage": True}, **logprobs)
    *chunks, last = _events(reply)
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": last["usage"]["prompt_tokens"], "completion_tokens": 3, "total_tokens": last["usage"]["prompt_tokens"] + 3}
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    if chat:
        assert [(c["token"], c["logprob"]) for p in parts for c in p["content"]] == list(zip(TOKENS, LOGPROBS))
    else:
        assert [t for p in parts for t in p["tokens"]] == TOKENS and [o for p in parts for o in p["text_offset"]] == [0, 1, 6]
    assert "usage" not in _events(_post(http, chat, stream=True))[-1]


@pytest.mark.parametrize(
    ("chat", "fields", "param"),
    [
        (True, {"top_logprobs": 2}, "top_logprobs"),
        (True, {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (True, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        (True, {"logprobs": True, "top_logprobs": True}, "top_logprobs"),
        (True, {"logprobs": "yes"}, "logprobs"),
        (False, {"logprobs": 6}, "logprobs"),
        (False, {"logprobs": -1}, "logprobs"),
        (False, {"logprobs": True}, "logprobs"),
        (True, {"presence_penalty": 0.5}, "presence_penalty"),
        (True, {"frequency_penalty": -1}, "frequency_penalty"),
        (True, {"logit_bias": {"28": 100}}, "logit_bias"),
        (True, {"response_format": {"type": "json_object"}}, "response_format"),
        (True, {"functions": [{"name": "f"}]}, "functions"),
        (True, {"tool_choice": "required"}, "tool_choice"),
        (False, {"best_of": 3}, "best_of"),
        (False, {"echo": True}, "echo"),
        (False, {"suffix": "}"}, "suffix"),
        (True, {"top_k": 5}, "top_k"),
        (True, {"min_tokens": 4}, "min_tokens"),
        (True, {"stream": True, "stream_options": {"include_usage": "y"}}, "stream_options"),
    ],
)
def test_fields_this_server_would_ignore_are_refused_by_name(http: Any, chat: bool, fields: dict[str, Any], param: str) -> None:
    reply = _post(http, chat, **fields)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_fields_at_the_values_that_ask_for_nothing_are_taken(http: Any) -> None:
    """What clients send by default (the openai library's zeros, an explicit null, a
    tool choice with no tools) is no request for anything."""
    fine = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"}, "tools": [], "tool_choice": "auto", "top_k": -1, "min_p": None, "min_tokens": 2, "user": "u-1"}
    assert _post(http, True, **fine).status_code == 200
    assert _post(http, False, best_of=1, echo=False, suffix=None).status_code == 200
