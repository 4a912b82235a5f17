"""The canary that proves a served model is the version it claims to be.

With every version the trainer publishes a few fixed token sequences and the log-probs
its own forward pass gives them under the new weights (``Canary`` in the version's
manifest). After applying a version, and before serving it, a rollout scores the same
sequences with its engine; :func:`compare` decides whether the two agree within what
two bf16 implementations of one model differ by.

Why these tolerances: on the built-in SmolLM2-135M, vLLM's CPU backend and a
transformers forward pass on the *same* bf16 weights differ by 0.03-0.09 nats per token
on average and by up to ~0.3 on single tokens (bf16 rounding through 30 layers, measured
on AVX2 and AVX-512 code paths); a model that mixes two versions, or one with a tensor
dropped or two swapped, is off by far more. The canary is the semantic check; the exact
check is the read-back of changed elements through the engine's kernels (rollout).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from meridian.v1 import weightsync_pb2 as pb

#: Texts the canary sequences are cut from: code, prose and a chat turn, so the
#: embedding rows, attention and the output head of common tokens all take part.
CANARY_TEXTS = (
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))\n",
    "The quick brown fox jumps over the lazy dog while the policy learns from its reward.",
    "Write a function that reverses a string.\n\ndef reverse(s: str) -> str:\n    return s[::-1]\n",
    "import os\nfor root, dirs, files in os.walk('.'):\n    print(root, len(files))\n",
)
MAX_TOKENS = 32

#: Mean over all canary tokens of |served - expected| (nats) above which a version is rejected.
DEFAULT_MEAN_TOLERANCE = 0.15
#: Largest single-token |served - expected| (nats) above which a version is rejected.
DEFAULT_MAX_TOLERANCE = 1.5


def canary_token_ids(encode: Callable[[str], list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """The canary's token sequences for a tokenizer (``encode`` maps text to ids)."""
    sequences = [list(encode(text))[:max_tokens] for text in CANARY_TEXTS]
    return [s for s in sequences if len(s) >= 2]


def build(sequences: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]]) -> pb.Canary:
    """The message for ``sequences`` and the producer's per-token log-probs (first is 0)."""
    if len(sequences) != len(logprobs):
        raise ValueError(f"{len(sequences)} sequences but {len(logprobs)} log-prob lists")
    out = pb.Canary()
    for ids, lps in zip(sequences, logprobs):
        if len(ids) != len(lps):
            raise ValueError(f"a canary sequence of {len(ids)} tokens has {len(lps)} log-probs")
        out.sequences.add(token_ids=list(ids), logprobs=[float(x) for x in lps])
    return out


@dataclasses.dataclass(frozen=True)
class CanaryVerdict:
    """How a served model's log-probs compare with the canary's."""

    ok: bool
    mean_diff: float
    max_diff: float
    tokens: int
    reason: str = ""


def compare(
    canary: pb.Canary,
    served: Sequence[Sequence[float]],
    mean_tolerance: float = DEFAULT_MEAN_TOLERANCE,
    max_tolerance: float = DEFAULT_MAX_TOLERANCE,
) -> CanaryVerdict:
    """Compares served log-probs (one list per canary sequence, first token ignored)."""
    if len(served) != len(canary.sequences):
        return CanaryVerdict(False, math.inf, math.inf, 0, f"{len(served)} scored sequences for a canary of {len(canary.sequences)}")
    diffs: list[float] = []
    for seq, got in zip(canary.sequences, served):
        if len(got) != len(seq.token_ids):
            return CanaryVerdict(False, math.inf, math.inf, 0, f"scored {len(got)} log-probs for a sequence of {len(seq.token_ids)}")
        diffs.extend(abs(float(a) - float(b)) for a, b in zip(got[1:], seq.logprobs[1:]))
    if not diffs:
        return CanaryVerdict(False, math.inf, math.inf, 0, "the canary has no tokens to score")
    if any(math.isnan(d) for d in diffs):
        return CanaryVerdict(False, math.inf, math.inf, len(diffs), "a served or expected log-prob is NaN")
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    reason = ""
    if mean > mean_tolerance:
        reason = f"canary log-probs differ by {mean:.3f} nats per token on average (tolerance {mean_tolerance})"
    elif worst > max_tolerance:
        reason = f"a canary token's log-prob differs by {worst:.3f} nats (tolerance {max_tolerance})"
    return CanaryVerdict(not reason, mean, worst, len(diffs), reason)
