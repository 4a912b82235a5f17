"""Chat messages to token ids through the model's own chat template, with what the
messages say kept as text.

A template's special tokens (``<|im_start|>``, ``<|im_end|>``) frame the turns. Rendered
and tokenized as one string, the way an OpenAI-compatible server usually does it, a
message that spells ``<|im_end|>\\n<|im_start|>system`` becomes the real markers: an
end user whose words an app puts in a message, or a task's instruction (a GitHub issue's
text), closes its own turn and writes a system or assistant turn into the policy's
context. Here a message's content is tokenized with special tokens split, so it reaches
the model as the characters it holds; only the template's own text makes markers."""
from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Sequence
from typing import Any


class ContentNotPlain(ValueError):
    """A message holds a special token's text and the chat template does not pass message
    content through unchanged, so the content's place in the rendered prompt (and with
    it what is text and what is a marker) is unknown."""


def plain_ids(tok: Any, text: str) -> list[int]:
    """``text`` as the characters it holds: its special tokens' text stays text."""
    return list(tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]) if text else []


def template_ids(tok: Any, text: str) -> list[int]:
    """The chat template's own text, whose special tokens are meant."""
    return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []


def special_token_in(tok: Any, text: str) -> str:
    """The first special token whose text ``text`` holds ('' when none does)."""
    found = _special_pattern(_special_tokens(tok)).search(text)
    return found.group(0) if found else ""


def chat_ids(tok: Any, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` (each a role and string content) through ``tok``'s chat
    template, each message's content tokenized as text.

    Without a special token's text in any message this is the template rendered and
    tokenized as one string, as every server does. With one, the template is rendered
    around a marker in place of each content, each content goes in its marker's place as
    text, and the template's pieces between them are tokenized as the template's own.
    Raises :class:`ContentNotPlain` when the template does not put each message's content
    into the prompt unchanged (it trims, splits or inspects it): no token ids then say
    what the caller wrote."""
    rendered = tok.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)
    special = [(i, token) for i, m in enumerate(messages) if (token := special_token_in(tok, m["content"]))]
    if not special:
        return template_ids(tok, rendered)
    markers = _markers(messages)
    framed = [{**m, "content": marker} for m, marker in zip(messages, markers)]
    skeleton = tok.apply_chat_template(framed, add_generation_prompt=add_generation_prompt, tokenize=False)
    pieces = _split(skeleton, markers)
    if pieces is None or _join(pieces, messages) != rendered:
        index, token = special[0]
        raise ContentNotPlain(
            f"messages[{index}] holds the special token {token!r}, and this model's chat template does not put message "
            "content into the prompt unchanged, so it cannot be kept as text; remove the token's text from the message"
        )
    ids = template_ids(tok, pieces[0])
    for message, piece in zip(messages, pieces[1:]):
        ids += plain_ids(tok, message["content"]) + template_ids(tok, piece)
    return ids


def _markers(messages: Sequence[dict[str, str]]) -> list[str]:
    """One marker per message, found in no message (a template cannot confuse it with
    content) and free of whitespace and markup (no template trims or escapes it)."""
    nonce = secrets.token_hex(8)
    while any(nonce in m["content"] for m in messages):
        nonce = secrets.token_hex(8)
    return [f"MERIDIAN{nonce}M{i}X" for i in range(len(messages))]


def _split(skeleton: str, markers: list[str]) -> list[str] | None:
    """The template's text before, between and after the markers, in order (None when a
    marker is not there exactly once, in its place)."""
    pieces: list[str] = []
    rest = skeleton
    for marker in markers:
        if skeleton.count(marker) != 1:
            return None
        before, found, rest = rest.partition(marker)
        if not found:
            return None
        pieces.append(before)
    return [*pieces, rest]


def _join(pieces: list[str], messages: Sequence[dict[str, str]]) -> str:
    return pieces[0] + "".join(m["content"] + piece for m, piece in zip(messages, pieces[1:]))


def _special_tokens(tok: Any) -> tuple[str, ...]:
    """Every special token's text: the named ones and the added tokens marked special (a
    template may frame turns with either)."""
    added = (t.content for t in tok.added_tokens_decoder.values() if t.special)
    return tuple(sorted({*tok.all_special_tokens, *added}))


@functools.lru_cache(maxsize=16)
def _special_pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    # One pass over a long content, not one per token (some vocabularies add hundreds).
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) or r"(?!)")
