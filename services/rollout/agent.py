"""The agent loop's pure core: the tool-call format, parsing, and the token ledger of
a multi-turn episode (what the model produced, with log-probs and versions, versus
tool observations, which are masked out of the loss).

Tool-call format (also what :data:`SYSTEM_PROMPT` tells the model)::

    <tool_call>{"name": "bash", "arguments": {"command": "ls -la"}}</tool_call>

Tools: ``bash(command)``, ``write_file(path, content)``, ``read_file(path)``,
``submit()``. A model turn ends at ``</tool_call>`` or at end of turn. A turn with no
tool call is the final answer: its first fenced code block (or the whole reply) is
written to the task's answer file, unless the model already wrote files, and the
episode is submitted for testing.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from services.rollout.prompt_limits import is_text

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOLS = ("bash", "write_file", "read_file", "submit")
MAX_OBSERVATION_CHARS = 2000

SYSTEM_PROMPT = (
    "You are a coding agent working in a sandboxed workspace. To use a tool, write exactly one block and stop:\n"
    f'{TOOL_CALL_OPEN}{{"name": "bash", "arguments": {{"command": "ls"}}}}{TOOL_CALL_CLOSE}\n'
    "Tools: bash(command), write_file(path, content), read_file(path), submit() (ends the episode and runs the tests).\n"
    "If you reply without a tool call, your reply is your answer: its code block is saved as {answer_path} and tested."
)

_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)(?:```|$)", re.DOTALL)


def extract_answer(text: str) -> str:
    """The first fenced code block of a reply, or the whole reply when it has none."""
    m = _FENCE.search(text)
    return m.group(1) if m else text


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_call(text: str) -> ToolCall | str | None:
    """The turn's tool call; None when the turn has none; an error message when malformed."""
    m = _CALL.search(text)
    if m is None:
        return "tool call not closed" if TOOL_CALL_OPEN in text else None
    try:
        data = json.loads(m.group(1))
    except json.JSONDecodeError as exc:
        return f"tool call is not valid JSON: {exc.msg}"
    if not isinstance(data, dict) or data.get("name") not in TOOLS:
        return f"tool call must name one of {', '.join(TOOLS)}"
    args = data.get("arguments", {})
    if not isinstance(args, dict):
        return "tool call arguments must be an object"
    required = {"bash": ("command",), "write_file": ("path", "content"), "read_file": ("path",), "submit": ()}[data["name"]]
    missing = [k for k in required if not isinstance(args.get(k), str)]
    if missing:
        return f"{data['name']} needs string argument(s): {', '.join(missing)}"
    # JSON's \\uD800-style escapes decode to lone surrogates, which no UTF-8 request to
    # envsandbox can carry: the model's mistake, answered as one, not a failed group.
    unencodable = [k for k in required if not is_text(args[k])]
    if unencodable:
        return f"{data['name']} argument(s) {', '.join(unencodable)} hold an unpaired surrogate escape (not text)"
    return ToolCall(data["name"], args)


def tool_response(text: str) -> str:
    """A tool's output as the user turn that carries it back to the model."""
    return "<tool_response>\n" + text + "\n</tool_response>"


def format_observation(text: str) -> str:
    """A tool's output as the model sees it, capped."""
    if len(text) > MAX_OBSERVATION_CHARS:
        text = text[:MAX_OBSERVATION_CHARS] + f"\n[... {len(text) - MAX_OBSERVATION_CHARS} more characters cut]"
    return text


@dataclasses.dataclass
class Ledger:
    """Every token after the prompt, with what the trainer needs per token."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    policy_versions: list[int] = dataclasses.field(default_factory=list)

    def add_model(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Model tokens exactly as sampled: trained on, with their behaviour log-probs."""
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"model turn with {len(ids)} tokens, {len(logprobs)} logprobs, {len(versions)} versions")
        self.token_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [1] * len(ids)
        self.policy_versions += versions

    def add_observation(self, ids: list[int]) -> None:
        """Tokens the model did not produce (tool output, turn markers): masked out."""
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.policy_versions += [-1] * len(ids)

    def __len__(self) -> int:
        return len(self.token_ids)
