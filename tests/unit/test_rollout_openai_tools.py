"""OpenAI function calling in the policy's own tool-call format: the pure core (offered
tools, calls found in a completion, what a stream holds back) and the HTTP API with an
engine that calls a tool."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from services.rollout.agent import TOOL_CALL_CLOSE
from services.rollout.openai_tools import Tools, ToolsError, assistant_calls_text, held_back, parse_tools, split_calls, with_tools
from tests.unit.test_rollout_chat_template import tok  # noqa: F401 - a fixture

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS = Tools({"get_weather": {"description": "Weather in a city.", "parameters": {}}})


def test_offered_tools_are_checked_and_a_forced_choice_is_refused() -> None:
    tools = parse_tools({"tools": [WEATHER], "tool_choice": "auto"})
    assert tools is not None and list(tools.functions) == ["get_weather"]
    assert '"city"' in tools.prompt() and "<tool_call>" in tools.prompt()
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert parse_tools({}) is None and parse_tools({"tools": []}) is None
    bad = [
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tools": {"get_weather": WEATHER}}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools"),
        ({"tools": [WEATHER] * 129}, "tools"),
    ]
    for body, param in bad:
        with pytest.raises(ToolsError) as caught:
            parse_tools(body)
        assert caught.value.param == param, body


def _named(i: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"f{i}"}}


def test_tools_are_bounded_by_count_and_each_field_by_its_type() -> None:
    """128 distinct functions are taken, a 129th is refused by the count (not only as a
    duplicate); a description that is not text, or tool_calls that are not a list, are
    refused naming the field instead of reaching the prompt."""
    assert len(parse_tools({"tools": [_named(i) for i in range(128)]}).functions) == 128  # type: ignore[union-attr]
    with pytest.raises(ToolsError, match="at most 128"):
        parse_tools({"tools": [_named(i) for i in range(129)]})
    with pytest.raises(ToolsError, match="description must be a string"):
        parse_tools({"tools": [{"type": "function", "function": {"name": "f", "description": ["x"]}}]})
    with pytest.raises(ToolsError, match=r"messages\[2\].tool_calls must be a list") as caught:
        assistant_calls_text({"function": {"name": "f", "arguments": "{}"}}, 2)
    assert caught.value.param == "messages"


def test_offered_tools_join_the_callers_own_system_message() -> None:
    """The tools' prompt is appended to the caller's system message, which is kept, or
    opens the conversation when there is none."""
    chat = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Weather?"}]
    joined = with_tools(chat, TOOLS)
    assert len(joined) == 2 and joined[0]["content"].startswith("Answer in French.\n\n") and joined[0]["content"].endswith(TOOLS.prompt())
    assert with_tools(chat[1:], TOOLS) == [{"role": "system", "content": TOOLS.prompt()}, chat[1]]
    assert with_tools(chat, None) == chat


def test_calls_are_found_where_they_call_an_offered_tool_with_an_object() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    # Stopped at the closing tag (the API's stop), or closed, with text around it.
    for text in (f"Let me check. {call}", f"Let me check. {call}{TOOL_CALL_CLOSE}"):
        content, calls = split_calls(text, TOOLS)
        assert content == "Let me check. " and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    for text in (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not offered
        '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',  # not an object
        "<tool_call>{not json</tool_call>",
        "no call at all",
    ):
        assert split_calls(text, TOOLS) == (text, []), text


def test_a_stream_pauses_where_a_call_may_begin() -> None:
    assert held_back("plain text") == len("plain text")
    assert held_back("text <tool") == len("text ")
    assert held_back("text <tool_call>{") == len("text ")
    assert held_back("a < b") == len("a < b")
    assert held_back("a <") == len("a "), "a lone '<' may begin a call"


def test_an_assistants_calls_render_as_the_blocks_it_wrote() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    text = assistant_calls_text(calls, 1)
    _, found = split_calls(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in found] == [("get_weather", {"city": "Paris"})]
    with pytest.raises(ToolsError, match="not JSON"):
        assistant_calls_text([{"function": {"name": "get_weather", "arguments": "{city"}}], 1)


class CallingEngine:
    """What the HTTP API needs of an engine: it records each request, and answers with
    text, then a call of get_weather, in pieces that split the opening tag."""

    version = 0
    pieces = ["Let me check. <tool_c", 'all>{"name": "get_weather", "arguments": {"city": "Paris"}}']

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: list[tuple[list[int], Any]] = []

    def prompt_problem(self, ids: list[int]) -> str:
        return ""

    async def generate(self, prompt_ids: list[int], sampling: Any, priority: int, request_id: str = "") -> AsyncIterator[Any]:
        from services.rollout.engine import Delta

        self.requests.append((prompt_ids, sampling))
        for k, text in enumerate(self.pieces):
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            last = k == len(self.pieces) - 1
            yield Delta(ids, [-0.5] * len(ids), self.version, text, last, "stop" if last else "")


@pytest.fixture
def http(tok: Any) -> Iterator[tuple[Any, CallingEngine]]:  # noqa: F811 - the imported fixture
    from fastapi.testclient import TestClient

    from services.rollout.callers import CallerClasses
    from services.rollout.openai_api import create_app

    engine = CallingEngine(tok)
    with TestClient(create_app(engine, "m", 2048, 64, CallerClasses({}, "production"))) as client:  # type: ignore[arg-type]
        yield client, engine


def _ask(client: Any, **fields: Any) -> Any:
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], **fields})


def test_a_call_comes_back_as_tool_calls(http: tuple[Any, CallingEngine], tok: Any) -> None:  # noqa: F811
    client, engine = http
    reply = _ask(client)
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    prompt, sampling = engine.requests[-1]
    assert "get_weather" in tok.decode(prompt) and TOOL_CALL_CLOSE in sampling.stop and not sampling.include_stop
    # Without tools the same text is plain content, and the turn does not stop at a call.
    plain = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"] and "<tool_call>" in plain["message"]["content"]
    assert TOOL_CALL_CLOSE not in engine.requests[-1][1].stop


def test_a_streamed_call_never_streams_as_text(http: tuple[Any, CallingEngine]) -> None:
    client, _ = http
    reply = _ask(client, stream=True)
    events = [json.loads(line.removeprefix("data: ")) for line in reply.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check. "
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [(0, "get_weather", {"city": "Paris"})]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_conversation_with_calls_and_results_reaches_the_model_in_the_trained_format(http: tuple[Any, CallingEngine], tok: Any) -> None:  # noqa: F811
    client, engine = http
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
    ]
    assert client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER]}).status_code == 200
    prompt = tok.decode(engine.requests[-1][0])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<tool_response>\n18 C, clear\n</tool_response>" in prompt
    refused = [
        ({"messages": [{"role": "user", "content": "x", "tool_calls": messages[1]["tool_calls"]}]}, "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ]
    for body, param in refused:
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (body, reply.text)
    reply = client.post("/v1/completions", json={"prompt": "x", "tools": [WEATHER]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools", reply.text
