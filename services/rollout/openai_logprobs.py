"""Sampled tokens' log-probs, and their most likely alternatives, in the OpenAI API's two
response shapes (chat's ``content`` list, completions' parallel lists)."""
from __future__ import annotations

from typing import Any, Protocol

#: One token's alternatives as text: (token text, log-prob), most likely first.
TextAlternatives = list[tuple[str, float]]


class _Decoder(Protocol):
    def batch_decode(self, sequences: list[list[int]]) -> list[str]: ...


def token_texts(tok: _Decoder, token_ids: list[int]) -> list[str]:
    """Each token's own text (a piece of a multi-byte character decodes to U+FFFD, as in
    vLLM's answers); one call into the tokenizer for all of them."""
    return tok.batch_decode([[t] for t in token_ids]) if token_ids else []


def alternative_texts(tok: _Decoder, top: list[list[tuple[int, float]]]) -> list[TextAlternatives]:
    """Each position's alternatives with their tokens as text; one call into the
    tokenizer for all positions."""
    texts = iter(token_texts(tok, [token for alts in top for token, _ in alts]))
    return [[(next(texts), logprob) for _, logprob in alts] for alts in top]


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(texts: list[str], logprobs: list[float], top: list[TextAlternatives] | None = None) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs`` object; ``top``: each token's alternatives
    (``top_logprobs``), none when not asked for."""
    # A token without alternatives gets an empty list rather than dropping out of the zip.
    tops = (top or []) + [[] for _ in range(len(texts) - len(top or []))]
    return {"content": [{**_entry(t, lp), "top_logprobs": [_entry(a, alp) for a, alp in alts]} for t, lp, alts in zip(texts, logprobs, tops)]}


def completion_logprobs(texts: list[str], logprobs: list[float], offset: int = 0, top: list[TextAlternatives] | None = None) -> dict[str, Any]:
    """A completion choice's (or chunk's) ``logprobs`` object; ``offset``: where in the
    choice's text the first of these tokens starts; ``top``: each token's alternatives
    (a completion's ``logprobs`` above 0), as the API's {text: log-prob} maps: two
    alternatives with the same text keep the more likely one's log-prob."""
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    maps = None if top is None else [_first_of_each_text(alts) for alts in top] + [{} for _ in range(len(texts) - len(top))]
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": maps, "text_offset": offsets}


def _first_of_each_text(alts: TextAlternatives) -> dict[str, float]:
    out: dict[str, float] = {}
    for text, logprob in alts:
        out.setdefault(text, logprob)
    return out
