"""Sampled tokens' log-probs in the OpenAI API's two response shapes (chat's ``content``
list, completions' parallel lists)."""
from __future__ import annotations

from typing import Any, Protocol


class _Decoder(Protocol):
    def batch_decode(self, sequences: list[list[int]]) -> list[str]: ...


def token_texts(tok: _Decoder, token_ids: list[int]) -> list[str]:
    """Each token's own text (a piece of a multi-byte character decodes to U+FFFD, as in
    vLLM's answers); one call into the tokenizer for all of them."""
    return tok.batch_decode([[t] for t in token_ids]) if token_ids else []


def chat_logprobs(texts: list[str], logprobs: list[float]) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs`` object."""
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in zip(texts, logprobs)]}


def completion_logprobs(texts: list[str], logprobs: list[float], offset: int = 0) -> dict[str, Any]:
    """A completion choice's (or chunk's) ``logprobs`` object; ``offset``: where in the
    choice's text the first of these tokens starts."""
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}
