"""The canary verdict (meridian.canary): what a rollout accepts or rejects before serving
a version, at the edges of its tolerances and on malformed input. The happy path and the
far-off model are in test_weight_updates_core."""
from __future__ import annotations

import math

import pytest

from meridian import canary


def _canary() -> object:
    # Log-probs and differences below are powers of two, so the means compare exactly.
    return canary.build([[1, 2, 3], [4, 5]], [[0.0, -1.0, -2.0], [0.0, -3.0]])


def test_a_mean_difference_equal_to_the_tolerance_is_accepted() -> None:
    """The tolerance is the largest mean accepted ("above which a version is rejected"):
    a model exactly at it serves, a hair above it does not."""
    served = [[0.0, -1.5, -2.5], [0.0, -3.5]]  # every token off by 0.5
    at = canary.compare(_canary(), served, mean_tolerance=0.5, max_tolerance=10.0)  # type: ignore[arg-type]
    assert at.ok and at.mean_diff == 0.5 and at.reason == ""
    above = canary.compare(_canary(), served, mean_tolerance=0.4999, max_tolerance=10.0)  # type: ignore[arg-type]
    assert not above.ok and "on average" in above.reason


def test_a_single_token_difference_equal_to_the_max_tolerance_is_accepted() -> None:
    served = [[0.0, -1.0, -2.0], [0.0, -5.0]]  # one token off by 2, the mean 2/3
    at = canary.compare(_canary(), served, mean_tolerance=1.0, max_tolerance=2.0)  # type: ignore[arg-type]
    assert at.ok and at.max_diff == 2.0
    above = canary.compare(_canary(), served, mean_tolerance=1.0, max_tolerance=1.999)  # type: ignore[arg-type]
    assert not above.ok and "a canary token" in above.reason


def test_the_first_tokens_score_is_ignored() -> None:
    """A first token has no context, so engines score it as anything (vLLM: None, others
    0 or a prior); only the tokens after it count."""
    verdict = canary.compare(_canary(), [[-50.0, -1.0, -2.0], [float("nan"), -3.0]])  # type: ignore[arg-type]
    assert verdict.ok and verdict.tokens == 3 and verdict.max_diff == 0.0


def test_a_nan_in_the_expected_log_probs_is_rejected() -> None:
    """A producer whose forward pass went NaN proves nothing: NaN compares false with
    every tolerance, so it has to be refused on its own."""
    probe = canary.build([[1, 2, 3]], [[0.0, float("nan"), -2.0]])
    verdict = canary.compare(probe, [[0.0, -1.0, -2.0]])
    assert not verdict.ok and "NaN" in verdict.reason and math.isinf(verdict.mean_diff)


@pytest.mark.parametrize("sequences", [[], [[7]], [[7], [8]]])
def test_a_canary_with_nothing_to_score_is_rejected(sequences: list[list[int]]) -> None:
    """No sequences, or only one-token ones (nothing after the ignored first token): a
    verdict with no evidence must not pass, and must not divide by zero either."""
    probe = canary.build(sequences, [[0.0] * len(s) for s in sequences])
    verdict = canary.compare(probe, [[0.0] * len(s) for s in sequences])
    assert not verdict.ok and verdict.tokens == 0 and "no tokens" in verdict.reason


def test_build_refuses_log_probs_that_do_not_match_the_sequences() -> None:
    """zip would silently drop the extra sequence or tokens; a canary cut short checks
    less than its producer thinks it does."""
    with pytest.raises(ValueError, match="2 sequences but 1 log-prob lists"):
        canary.build([[1, 2], [3, 4]], [[0.0, -1.0]])
    with pytest.raises(ValueError, match="3 tokens has 2 log-probs"):
        canary.build([[1, 2, 3]], [[0.0, -1.0]])


def test_canary_token_ids_are_cut_to_max_tokens_and_drop_sequences_too_short_to_score() -> None:
    def encode(text: str) -> list[int]:
        return list(text.encode())  # a byte tokenizer: one id per byte

    ids = canary.canary_token_ids(encode, max_tokens=5)
    assert ids == [list(text.encode()[:5]) for text in canary.CANARY_TEXTS]
    assert canary.canary_token_ids(encode, max_tokens=1) == []  # one token scores nothing
    assert canary.canary_token_ids(lambda text: [] if "fox" in text else [1, 2]) == [[1, 2]] * (len(canary.CANARY_TEXTS) - 1)


def test_default_tolerances_accept_measured_bf16_noise_and_reject_one_token_far_off() -> None:
    """The defaults are the module's measured bounds: two bf16 implementations of one model
    differ by up to ~0.09 nats per token on average and ~0.3 on a single token, and must
    pass; a single token 2 nats off, far beyond that noise, must not, even when the
    average over the canary stays low."""
    expected = [0.0] + [-1.0] * 20
    probe = canary.build([list(range(21))], [expected])
    noisy = [0.0] + [-1.08] * 19 + [-1.3]
    verdict = canary.compare(probe, [noisy])
    assert verdict.ok and 0.09 <= verdict.mean_diff < 0.1, verdict
    one_far = [0.0] + [-1.0] * 19 + [-3.0]
    verdict = canary.compare(probe, [one_far])
    assert not verdict.ok and verdict.mean_diff < canary.DEFAULT_MEAN_TOLERANCE and "a canary token" in verdict.reason
