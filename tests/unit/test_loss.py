"""GRPO loss and batch building, against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from meridian.v1 import common_pb2
from services.trainer.batch import build_batch, token_logprobs
from services.trainer.loss import LossConfig, clipped_pg_loss, group_advantages, token_scale

F64 = torch.float64


# ---------------------------------------------------------------- group_advantages


def test_group_advantages_normalised_by_population_std() -> None:
    # rewards 0, 1, 2: mean 1, centred -1, 0, 1, population std sqrt(2/3).
    adv = group_advantages(torch.tensor([0.0, 1.0, 2.0], dtype=F64), normalize_std=True, eps=0.0)
    k = math.sqrt(1.5)
    torch.testing.assert_close(adv, torch.tensor([-k, 0.0, k], dtype=F64))


def test_group_advantages_eps_is_added_to_std() -> None:
    # rewards 1, 0, 0, 1: centred +-0.5, std 0.5 -> +-0.5 / (0.5 + eps).
    eps = 0.25
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64), normalize_std=True, eps=eps)
    v = 0.5 / (0.5 + eps)
    torch.testing.assert_close(adv, torch.tensor([v, -v, -v, v], dtype=F64))


def test_group_advantages_without_std_is_centred_reward() -> None:
    adv = group_advantages(torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=F64), normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([2.0, 0.0, -1.0, -1.0], dtype=F64))


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_all_equal_rewards_are_zero(normalize_std: bool) -> None:
    adv = group_advantages(torch.full((4,), 0.7), normalize_std=normalize_std)
    assert torch.equal(adv, torch.zeros(4))
    assert torch.isfinite(adv).all()


def test_group_advantages_single_sample_is_zero() -> None:
    # A group of one has no relative signal (and no std to divide by).
    assert torch.equal(group_advantages(torch.tensor([5.0])), torch.zeros(1))


def test_group_advantages_sum_to_zero() -> None:
    adv = group_advantages(torch.tensor([0.1, 0.9, 0.4, 0.4, 1.0], dtype=F64))
    assert abs(float(adv.sum())) < 1e-12


# ---------------------------------------------------------------- clipped_pg_loss

# Row 0 has advantage +2, row 1 advantage -1; bounds are [0.8, 1.28].
RATIOS = [[1.1, 1.5, 0.5], [1.5, 0.5, 0.9]]
ADVANTAGES = [[2.0], [-1.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
# Per token, -min(r*A, clip(r)*A):
#   row 0: 1.1 inside -> -2.2; 1.5 above, A>0, clip binds -> -2.56; 0.5 below, A>0,
#          clip does not bind (r*A=1.0 < 1.6) -> -1.0
#   row 1: 1.5 above, A<0, clip does not bind (-1.5 < -1.28) -> 1.5; 0.5 below, A<0,
#          clip binds (-0.8 < -0.5) -> 0.8; 0.9 masked out.
N_TOKENS = 5
EXPECTED_LOSS = (-2.2 - 2.56 - 1.0 + 1.5 + 0.8) / N_TOKENS
# d loss / d logprob = -A * r / N where the unclipped term is the minimum, 0 where the
# clip binds or the token is masked.
EXPECTED_GRAD = [[-2.2 / N_TOKENS, 0.0, -1.0 / N_TOKENS], [1.5 / N_TOKENS, 0.0, 0.0]]


def _loss_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    behaviour = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.25, -1.5]], dtype=F64)
    logprobs = (behaviour + torch.log(torch.tensor(RATIOS, dtype=F64))).requires_grad_(True)
    return logprobs, behaviour, torch.tensor(ADVANTAGES, dtype=F64), torch.tensor(MASK)


def test_clipped_pg_loss_value() -> None:
    logprobs, behaviour, adv, mask = _loss_inputs()
    loss, _ = clipped_pg_loss(logprobs, behaviour, adv, mask, LossConfig(clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx(EXPECTED_LOSS, abs=1e-12)


def test_clipped_pg_loss_gradient_matches_hand_derivation() -> None:
    logprobs, behaviour, adv, mask = _loss_inputs()
    loss, _ = clipped_pg_loss(logprobs, behaviour, adv, mask, LossConfig(clip_low=0.2, clip_high=0.28))
    loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor(EXPECTED_GRAD, dtype=F64), atol=1e-12, rtol=0)


def test_clipped_pg_loss_stats() -> None:
    logprobs, behaviour, adv, mask = _loss_inputs()
    _, stats = clipped_pg_loss(logprobs, behaviour, adv, mask, LossConfig(clip_low=0.2, clip_high=0.28))
    assert stats["tokens"] == N_TOKENS
    # Four unmasked ratios lie outside [0.8, 1.28] (whether or not the clip binds).
    assert stats["clip_frac"] == pytest.approx(4 / N_TOKENS)
    assert stats["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5 + 1.5 + 0.5) / N_TOKENS)


def test_clipped_pg_loss_asymmetric_bounds() -> None:
    # r = 1.25 is inside 1 + clip_high = 1.28 but outside a symmetric 1 + 0.2.
    behaviour = torch.zeros(1, 1, dtype=F64)
    logprobs = torch.full((1, 1), math.log(1.25), dtype=F64, requires_grad=True)
    adv = torch.ones(1, 1, dtype=F64)
    loss, _ = clipped_pg_loss(logprobs, behaviour, adv, torch.ones(1, 1), LossConfig(clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx(-1.25)
    loss.backward()
    assert logprobs.grad is not None and logprobs.grad.item() == pytest.approx(-1.25)
    loss_sym, _ = clipped_pg_loss(logprobs.detach(), behaviour, adv, torch.ones(1, 1), LossConfig(clip_low=0.2, clip_high=0.2))
    assert loss_sym.item() == pytest.approx(-1.2)


def test_clipped_pg_loss_is_masked_mean() -> None:
    logprobs, behaviour, adv, mask = _loss_inputs()
    cfg = LossConfig()
    base, _ = clipped_pg_loss(logprobs, behaviour, adv, mask, cfg)
    # Changing a masked-out token's log-prob changes nothing.
    changed = logprobs.detach().clone()
    changed[1, 2] += 3.0
    again, _ = clipped_pg_loss(changed, behaviour, adv, mask, cfg)
    assert again.item() == pytest.approx(base.item(), abs=1e-12)
    # Masking a token removes it from numerator and denominator alike.
    one = torch.tensor([[1, 0, 0], [0, 0, 0]])
    single, _ = clipped_pg_loss(logprobs, behaviour, adv, one, cfg)
    assert single.item() == pytest.approx(-2.2)


def test_clipped_pg_loss_all_masked_is_zero_not_nan() -> None:
    logprobs, behaviour, adv, _ = _loss_inputs()
    loss, stats = clipped_pg_loss(logprobs, behaviour, adv, torch.zeros(2, 3))
    assert loss.item() == 0.0
    assert stats["tokens"] == 0.0
    loss.backward()
    assert logprobs.grad is not None and torch.equal(logprobs.grad, torch.zeros(2, 3, dtype=F64))


def test_clipped_pg_loss_on_policy_is_minus_mean_advantage() -> None:
    # ratio 1 everywhere: the loss is -mean(A) over tokens and the gradient is -A/N.
    behaviour = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], dtype=F64)
    logprobs = behaviour.clone().requires_grad_(True)
    adv = torch.tensor([[1.0], [-3.0]], dtype=F64)
    loss, stats = clipped_pg_loss(logprobs, behaviour, adv, torch.ones(2, 2))
    assert loss.item() == pytest.approx(-(1 + 1 - 3 - 3) / 4)
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, -0.25], [0.75, 0.75]], dtype=F64))


# ---------------------------------------------------------------- build_batch / token_logprobs


def _traj(
    tid: str,
    group: str,
    prompt: list[int],
    completion: list[int],
    reward: float,
    logprobs: list[float] | None = None,
    mask: list[int] | None = None,
    group_size: int = 2,
) -> common_pb2.Trajectory:
    n = len(completion)
    return common_pb2.Trajectory(
        trajectory_id=tid,
        group_id=group,
        group_size=group_size,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=logprobs if logprobs is not None else [-0.5] * n,
        loss_mask=mask if mask is not None else [1] * n,
        policy_versions=[0] * n,
        reward=reward,
    )


PAD = 99


def _two_trajectories() -> list[common_pb2.Trajectory]:
    # a: prompt of 3, completion of 2 (second token is a masked tool token)
    # b: prompt of 1, completion of 3
    a = _traj("a", "g", [5, 6, 7], [8, 9], 1.0, logprobs=[-0.5, -0.25], mask=[1, 0])
    b = _traj("b", "g", [5], [20, 21, 22], 0.0, logprobs=[-1.0, -2.0, -3.0], mask=[1, 1, 1])
    return [a, b]


def test_build_batch_pads_right() -> None:
    batch = build_batch([_two_trajectories()], pad_id=PAD)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 20, 21, 22, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.input_ids.dtype == torch.long


def test_build_batch_target_positions_predict_completion_tokens() -> None:
    batch = build_batch([_two_trajectories()], pad_id=PAD)
    # Position t predicts input_ids[t + 1]; completion token j (at p + j) comes from p + j - 1.
    assert batch.target_mask.shape == (2, 4)
    assert batch.target_mask.tolist() == [[0, 0, 1, 0], [1, 1, 1, 0]]
    assert batch.behaviour_logprobs.tolist() == [[0, 0, -0.5, -0.25], [-1.0, -2.0, -3.0, 0]]
    for i, traj in enumerate(_two_trajectories()):
        p = len(traj.prompt_token_ids)
        for j, token in enumerate(traj.completion_token_ids):
            assert batch.input_ids[i, p + j + 0].item() == token
            assert batch.behaviour_logprobs[i, p + j - 1].item() == pytest.approx(traj.logprobs[j])
            assert batch.target_mask[i, p + j - 1].item() == traj.loss_mask[j]


def test_build_batch_token_logprobs_line_up_with_behaviour() -> None:
    # Logits that put probability ~1 on the real next token: the model's log-probs at
    # target positions are then ~0, and at every other position they are ignored.
    batch = build_batch([_two_trajectories()], pad_id=PAD)
    b, t = batch.input_ids.shape
    logits = torch.full((b, t, 128), -30.0)
    for i in range(b):
        for pos in range(t - 1):
            logits[i, pos, batch.input_ids[i, pos + 1]] = 30.0
    lp = token_logprobs(logits, batch.input_ids)
    assert lp.shape == batch.target_mask.shape
    assert (lp.abs() < 1e-6).all()


def test_token_logprobs_matches_log_softmax_gather() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 7, generator=gen)
    ids = torch.tensor([[1, 2, 3, 4], [6, 5, 0, 0]])
    lp = token_logprobs(logits, ids)
    for i in range(2):
        for pos in range(3):
            want = torch.log_softmax(logits[i, pos], dim=-1)[ids[i, pos + 1]]
            assert lp[i, pos].item() == pytest.approx(want.item(), abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_chunked_token_logprobs_give_the_full_log_softmax_values_and_gradients(chunk: int) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 6, 11, generator=gen, dtype=F64, requires_grad=True)
    ids = torch.randint(0, 11, (3, 6), generator=gen)
    weights = torch.randn(3, 5, generator=gen, dtype=F64)
    full = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    (full * weights).sum().backward()
    want_grad = logits.grad.clone()
    logits.grad = None
    lp = token_logprobs(logits, ids, chunk=chunk)
    torch.testing.assert_close(lp, full.detach().float(), atol=1e-6, rtol=0)
    (lp.double() * weights).sum().backward()
    torch.testing.assert_close(logits.grad, want_grad, atol=1e-6, rtol=0)


def test_build_batch_advantages_per_group() -> None:
    g1 = [_traj("a", "g1", [1], [2], 1.0), _traj("b", "g1", [1], [2], 0.0)]
    g2 = [_traj("c", "g2", [1], [2], 0.5), _traj("d", "g2", [1], [2], 0.5)]
    batch = build_batch([g1, g2], pad_id=PAD, loss=LossConfig(normalize_std=False))
    assert batch.advantages.shape == (4, 1)
    assert batch.advantages.squeeze(1).tolist() == [0.5, -0.5, 0.0, 0.0]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5, 0.5]
    normed = build_batch([g1, g2], pad_id=PAD)
    torch.testing.assert_close(normed.advantages.squeeze(1), torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5, rtol=0)


def test_build_batch_feeds_clipped_pg_loss() -> None:
    # End to end on-policy: logprobs equal to behaviour give -mean(A) over target tokens.
    batch = build_batch([_two_trajectories()], pad_id=PAD, loss=LossConfig(normalize_std=False))
    loss, stats = clipped_pg_loss(batch.behaviour_logprobs.clone(), batch.behaviour_logprobs, batch.advantages, batch.target_mask)
    # advantages +0.5 (1 token of a) and -0.5 (3 tokens of b) -> -(0.5 - 1.5) / 4
    assert stats["tokens"] == 4
    assert loss.item() == pytest.approx(0.25)


# ---------------------------------------------------------------- validation


def test_trajectory_with_empty_prompt_is_rejected_before_batching() -> None:
    """Its first completion token has nothing to be predicted from; it must go to the dead letters."""
    from meridian.trajectory_transport import validate

    no_prompt = _traj("a", "g", [], [5, 6], 1.0)
    assert "prompt" in validate(no_prompt)


# ---------------------------------------------------------------- truncated importance sampling, KL, weights


def test_tis_value_and_gradient_by_hand() -> None:
    # Decoupled objective: ratio against the trainer's own log-probs is exactly 1, so the
    # loss is -mean(w * A) with w = min(pi / mu, cap), and d loss / d logp = -w * A / N.
    logprobs = torch.tensor([[math.log(0.5), math.log(0.9)], [math.log(0.2), math.log(0.6)]], dtype=F64, requires_grad=True)
    behaviour = torch.tensor([[math.log(0.25), math.log(0.9)], [math.log(0.4), math.log(0.1)]], dtype=F64)
    adv = torch.tensor([[1.0], [-2.0]], dtype=F64)
    cap = 3.0
    # weights: 0.5/0.25 = 2; 1; 0.2/0.4 = 0.5; 0.6/0.1 = 6 -> truncated to 3
    w = [[2.0, 1.0], [0.5, 3.0]]
    loss, stats = clipped_pg_loss(logprobs, behaviour, adv, torch.ones(2, 2), LossConfig(tis_cap=cap))
    want = -(2.0 * 1 + 1.0 * 1 + 0.5 * -2 + 3.0 * -2) / 4
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert stats["is_truncated_frac"] == pytest.approx(0.25)
    assert stats["is_weight_mean"] == pytest.approx((2 + 1 + 0.5 + 3) / 4)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-w[0][0] / 4, -w[0][1] / 4], [2 * w[1][0] / 4, 2 * w[1][1] / 4]], dtype=F64))


def test_tis_weights_do_not_carry_gradient() -> None:
    # With every weight truncated, the gradient is -cap * A / N whatever the ratio.
    logprobs = torch.full((1, 3), -0.1, dtype=F64, requires_grad=True)
    behaviour = torch.full((1, 3), -5.0, dtype=F64)
    loss, _ = clipped_pg_loss(logprobs, behaviour, torch.ones(1, 1, dtype=F64), torch.ones(1, 3), LossConfig(tis_cap=2.0))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.full((1, 3), -2.0 / 3, dtype=F64))


def test_kl_penalty_value_and_gradient() -> None:
    # k3 estimator: exp(d) - d - 1 with d = ref - logp; derivative w.r.t. logp is 1 - exp(d).
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    coef = 0.1
    adv = torch.zeros(1, 1, dtype=F64)  # isolate the KL term
    loss, stats = clipped_pg_loss(logprobs, logprobs.detach(), adv, torch.ones(1, 2), LossConfig(kl_coef=coef), ref_logprobs=ref)
    d = [-0.5, 1.0]
    kl = [math.exp(x) - x - 1 for x in d]
    assert loss.item() == pytest.approx(coef * sum(kl) / 2, abs=1e-12)
    assert stats["kl"] == pytest.approx(sum(kl) / 2)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[coef * (1 - math.exp(x)) / 2 for x in d]], dtype=F64))


def test_token_weights_and_global_token_count() -> None:
    logprobs, behaviour, adv, mask = _loss_inputs()
    weights = torch.tensor([[1.0], [0.0]], dtype=F64)  # the second sequence contributes nothing
    loss, _ = clipped_pg_loss(logprobs, behaviour, adv, mask, LossConfig(), token_weights=weights)
    assert loss.item() == pytest.approx((-2.2 - 2.56 - 1.0) / N_TOKENS, abs=1e-12)
    # A shard divides by the whole batch's token count, so shard losses add up.
    scale = token_scale(mask)
    rows = [clipped_pg_loss(logprobs[i : i + 1], behaviour[i : i + 1], adv[i : i + 1], mask[i : i + 1], LossConfig(), scale=scale[i : i + 1])[0] for i in range(2)]
    assert sum(r.item() for r in rows) == pytest.approx(EXPECTED_LOSS, abs=1e-12)


# Per-token terms of _loss_inputs: row 0 (3 tokens) sums to -5.76, row 1 (2 tokens) to 2.3.
ROW_SUMS, ROW_TOKENS = (-2.2 - 2.56 - 1.0, 1.5 + 0.8), (3, 2)


@pytest.mark.parametrize(
    ("loss_config", "expected"),
    [
        # DAPO: every token of the batch weighs the same.
        (LossConfig(), sum(ROW_SUMS) / sum(ROW_TOKENS)),
        # GRPO paper: mean per sequence, then over sequences.
        (LossConfig(aggregation="seq-mean"), (ROW_SUMS[0] / 3 + ROW_SUMS[1] / 2) / 2),
        # Dr. GRPO: sum per sequence over a constant budget (4 tokens), mean over sequences.
        (LossConfig(aggregation="dr-grpo", token_budget=4), (ROW_SUMS[0] + ROW_SUMS[1]) / (4 * 2)),
    ],
    ids=["token-mean", "seq-mean", "dr-grpo"],
)
def test_loss_aggregations_match_hand_values_and_shards_add_up(loss_config: LossConfig, expected: float) -> None:
    logprobs, behaviour, adv, mask = _loss_inputs()
    scale = token_scale(mask, loss_config.aggregation, loss_config.token_budget)
    loss, _ = clipped_pg_loss(logprobs, behaviour, adv, mask, loss_config, scale=scale)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    rows = [clipped_pg_loss(logprobs[i : i + 1], behaviour[i : i + 1], adv[i : i + 1], mask[i : i + 1], loss_config, scale=scale[i : i + 1])[0] for i in range(2)]
    assert sum(r.item() for r in rows) == pytest.approx(expected, abs=1e-12)


def test_seq_mean_ignores_rows_without_trained_tokens() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    scale = token_scale(mask, "seq-mean")
    # Two sequences carry tokens: 1 / (2 * 2) for the first, 1 / (2 * 1) for the third.
    assert scale[0, 0].item() == pytest.approx(0.25) and scale[2, 0].item() == pytest.approx(0.5)


def test_unknown_aggregation_and_missing_budget_are_refused() -> None:
    with pytest.raises(ValueError, match="loss aggregation"):
        LossConfig(aggregation="sum")
    with pytest.raises(ValueError, match="token budget"):
        LossConfig(aggregation="dr-grpo")


def test_sample_std_divides_by_n_minus_one() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0], dtype=F64)
    # Sample std of (0, 1, 2) is 1; the population std is sqrt(2/3).
    assert group_advantages(rewards, eps=0.0, sample_std=True).tolist() == pytest.approx([-1.0, 0.0, 1.0])
    assert group_advantages(rewards, eps=0.0).tolist() == pytest.approx([-1.0 / math.sqrt(2 / 3), 0.0, 1.0 / math.sqrt(2 / 3)])


def test_dr_grpo_batches_have_no_std_scaling() -> None:
    g = _two_trajectories()
    rewards = [t.reward for t in g]
    batch = build_batch([g], pad_id=PAD, loss=LossConfig(aggregation="dr-grpo", token_budget=8))
    mean = sum(rewards) / len(rewards)
    assert batch.advantages.squeeze(1).tolist() == pytest.approx([r - mean for r in rewards])
    # The batch carries Dr. GRPO's constant factor for every token: 1 / (budget * sequences).
    assert torch.all(batch.token_scale == 1.0 / (8 * len(g)))


def test_ratio_is_taken_against_the_behaviour_logprobs_not_the_current_ones() -> None:
    # Coupled objective (tis_cap 0): the ratio is pi / pi_behaviour. With the current
    # log-probs in place of the behaviour ones every ratio would be 1 and the loss -A.
    behaviour = torch.tensor([[-1.0]], dtype=F64)
    logprobs = torch.tensor([[-1.0 + math.log(1.1)]], dtype=F64)
    adv = torch.ones(1, 1, dtype=F64)
    loss, _ = clipped_pg_loss(logprobs, behaviour, adv, torch.ones(1, 1))
    assert loss.item() == pytest.approx(-1.1)
    # Decoupled (tis_cap 2): ratio 1 against the proximal policy, weighted by
    # min(pi / pi_behaviour, cap).
    loss_tis, stats = clipped_pg_loss(logprobs, behaviour, adv, torch.ones(1, 1), LossConfig(tis_cap=2.0))
    assert loss_tis.item() == pytest.approx(-1.1) and stats["is_weight_mean"] == pytest.approx(1.1)


# ---------------------------------------------------------------- staleness and group filtering


def test_staleness_weight_modes() -> None:
    from services.trainer.loss import staleness_weight

    assert staleness_weight(2, 2, "drop", 0.25) == 1.0
    assert staleness_weight(3, 2, "drop", 0.25) == 0.0
    assert staleness_weight(3, 2, "downweight", 0.25) == 0.25
    with pytest.raises(ValueError):
        staleness_weight(0, 2, "ignore", 0.25)


def test_has_reward_signal() -> None:
    from services.trainer.loss import has_reward_signal

    assert has_reward_signal([0.0, 1.0]) and not has_reward_signal([0.5, 0.5]) and not has_reward_signal([1.0])


def _versioned(tid: str, group: str, version: int, reward: float) -> common_pb2.Trajectory:
    t = _traj(tid, group, [1], [2, 3, 4], reward, mask=[1, 0, 1])
    t.policy_versions[:] = [version, -1, version + 1]
    return t


def test_policy_lag_uses_the_oldest_trained_token() -> None:
    from services.trainer.batch import policy_lag

    assert policy_lag(_versioned("a", "g", 3, 1.0), 7) == 4  # tool token (-1) is not trained
    assert policy_lag(_versioned("a", "g", 9, 1.0), 7) == 0


def _config(**kw: object):  # type: ignore[no-untyped-def]
    from services.trainer.config import TrainerConfig

    return TrainerConfig(**{"max_policy_lag": 2, **kw})  # type: ignore[arg-type]


def test_prepare_groups_drop_mode_counts() -> None:
    from services.trainer.learner import prepare_groups

    fresh = [_versioned("a1", "A", 5, 1.0), _versioned("a2", "A", 5, 0.0)]
    mixed = [_versioned("b1", "B", 5, 1.0), _versioned("b2", "B", 1, 0.0), _versioned("b3", "B", 5, 0.0)]
    lone = [_versioned("c1", "C", 5, 1.0), _versioned("c2", "C", 0, 0.0)]
    flat = [_versioned("d1", "D", 5, 0.5), _versioned("d2", "D", 5, 0.5)]
    out = prepare_groups([fresh, mixed, lone, flat], version=6, config=_config())
    assert [[t.trajectory_id for t in g] for g in out.groups] == [["a1", "a2"], ["b1", "b3"]]
    assert out.dropped_stale == 1 + 2  # b2; c2 and then c1, left alone
    assert out.dropped_groups == 1 and out.downweighted_stale == 0
    assert out.lags == [1, 1, 1, 5, 1, 1, 6, 1, 1]


def test_prepare_groups_downweight_mode_and_equal_rewards_kept_when_asked() -> None:
    from services.trainer.learner import prepare_groups

    group = [_versioned("a1", "A", 5, 1.0), _versioned("a2", "A", 0, 0.0)]
    flat = [_versioned("d1", "D", 5, 0.5), _versioned("d2", "D", 5, 0.5)]
    out = prepare_groups([group, flat], version=6, config=_config(stale_mode="downweight", stale_weight=0.5, drop_equal_reward_groups=False))
    assert out.weights == [[1.0, 0.5], [1.0, 1.0]]
    assert out.downweighted_stale == 1 and out.dropped_stale == 0 and out.dropped_groups == 0


def test_build_batch_carries_sequence_weights() -> None:
    batch = build_batch([_two_trajectories()], pad_id=PAD, weights=[[1.0, 0.25]])
    assert batch.token_weights.squeeze(1).tolist() == [1.0, 0.25]
    assert build_batch([_two_trajectories()], pad_id=PAD).token_weights.squeeze(1).tolist() == [1.0, 1.0]
