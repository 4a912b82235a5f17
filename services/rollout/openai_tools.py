"""OpenAI function calling, spoken in the tool-call format the policy is trained with.

In RL episodes the model calls tools as ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` and reads their output in a user turn wrapped in ``<tool_response>``
(:mod:`services.rollout.agent`, :mod:`services.rollout.episodes`). Production traffic
on the same engine gets the same format, so what RL teaches is what callers use:

- a request's ``tools`` become a system message listing them in that format (after the
  caller's own system message, or as the first message);
- an assistant message's ``tool_calls`` become its blocks, and a ``tool`` message becomes
  the user turn an episode's observation is;
- a completion's blocks that call an offered tool with an object of arguments come back
  as ``tool_calls`` (``finish_reason: "tool_calls"``); the text around them is the
  content, and a block that is not such a call stays text.

The model cannot be forced to call a tool (no constrained decoding), so ``tool_choice``
``"required"`` or a named function is refused rather than ignored. Pure logic; no HTTP.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from services.rollout.agent import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL)

TOOLS_PROMPT = (
    "You can call these tools. To call one, write exactly one block and stop:\n"
    f'{TOOL_CALL_OPEN}{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}{TOOL_CALL_CLOSE}\n'
    "Its result comes back in the next message. Tools:"
)


class ToolsError(ValueError):
    """A request whose tools, tool choice or tool messages cannot be taken; ``param``
    names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Tools:
    """The functions a request offers the model, by name."""

    functions: dict[str, dict[str, Any]]

    def prompt(self) -> str:
        """The system text that offers them, in the trained tool-call format."""
        lines = [TOOLS_PROMPT]
        for name, spec in self.functions.items():
            parameters = json.dumps(spec.get("parameters") or {"type": "object", "properties": {}}, sort_keys=True)
            description = spec.get("description") or ""
            lines.append(f"- {name}: {description} Arguments (JSON schema): {parameters}" if description else f"- {name}: arguments (JSON schema): {parameters}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ToolCallOut:
    """A tool call the model made, as the API returns it."""

    name: str
    arguments: str  # a JSON object, as OpenAI sends arguments
    id: str = dataclasses.field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """The tools a request offers the model (None: none, or ``tool_choice: "none"``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto"):
        what = "a named function" if isinstance(choice, dict) else repr(choice)
        raise ToolsError(f"'tool_choice' {what} cannot be honoured here (the model is never forced to call a tool); use 'auto' or 'none'", "tool_choice")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolsError(f"'tools' must be a list of at most {MAX_TOOLS} functions", "tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise ToolsError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name, description, parameters = function.get("name"), function.get("description"), function.get("parameters")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolsError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}", "tools")
        if name in functions:
            raise ToolsError(f"tools[{i}]: a second function named {name!r}", "tools")
        if description is not None and not isinstance(description, str):
            raise ToolsError(f"tools[{i}].function.description must be a string", "tools")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolsError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions[name] = {"description": description, "parameters": parameters}
    return None if choice == "none" else Tools(functions)


def with_tools(messages: list[dict[str, str]], tools: Tools | None) -> list[dict[str, str]]:
    """``messages`` (plain role and text) with the tools offered in a system message."""
    if tools is None:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + tools.prompt()}, *messages[1:]]
    return [{"role": "system", "content": tools.prompt()}, *messages]


def assistant_calls_text(calls: Any, i: int) -> str:
    """An assistant message's ``tool_calls`` as the blocks the model wrote."""
    if not isinstance(calls, list):
        raise ToolsError(f"messages[{i}].tool_calls must be a list", "messages")
    blocks = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise ToolsError(f"messages[{i}].tool_calls[{j}] needs a function with a name and arguments (a JSON string)", "messages")
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ToolsError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {exc.msg}", "messages") from None
        blocks.append(TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": parsed}) + TOOL_CALL_CLOSE)
    return "".join(blocks)


def split_calls(text: str, tools: Tools) -> tuple[str, list[ToolCallOut]]:
    """A completion's content (the text outside the calls' blocks, as written) and the
    tool calls in it. A block counts when its JSON names an offered tool and its arguments
    are an object; its closing tag may be missing (the completion stopped at it). Anything
    else stays in the content."""
    calls: list[ToolCallOut] = []
    kept: list[str] = []
    at = 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1), tools)
        if call is None:
            continue
        kept.append(text[at : m.start()])
        calls.append(call)
        at = m.end()
    kept.append(text[at:])
    return "".join(kept), calls


def _call(body: str, tools: Tools) -> ToolCallOut | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in tools.functions:
        return None
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCallOut(data["name"], json.dumps(arguments))


def held_back(text: str) -> int:
    """Where a streamed completion's content must pause: at a block's start, or at a
    tail that may be the start of one (``<tool``), so a call never streams as text."""
    at = text.find(TOOL_CALL_OPEN)
    if at >= 0:
        return at
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return len(text) - k
    return len(text)
