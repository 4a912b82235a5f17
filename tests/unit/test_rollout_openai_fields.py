"""The OpenAI API's request fields beyond the prompt: the sampled tokens' log-probs (what
an RL caller trains against), a stream's usage chunk, and fields this server does not
implement, refused by name rather than ignored."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.unit.test_rollout_chat_template import RecordingEngine, tok  # noqa: F401 - tok: a fixture

TOKENS, LOGPROBS = [",", " Fire", ","], [-0.5, -1.25, -0.125]


@pytest.fixture
def http(tok: Any) -> Iterator[Any]:  # noqa: F811 - the imported fixture
    from fastapi.testclient import TestClient

    from services.rollout.callers import CallerClasses
    from services.rollout.openai_api import create_app

    with TestClient(create_app(RecordingEngine(tok), "m", 2048, 64, CallerClasses({}, "production"))) as client:  # type: ignore[arg-type]
        yield client


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
        (True, {"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
        (True, {"logprobs": "yes"}, "logprobs"),
        (False, {"logprobs": 5}, "logprobs"),
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
