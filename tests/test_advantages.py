"""Advantage estimators and reward shaping against numbers computed by hand."""

import math
import typing

import pytest
import torch

from asyncrl.config import ConfigError
from asyncrl.train.advantages import ESTIMATORS, AdvantageInputs, batch_normalized_advantages, compute_advantages, drgrpo_advantages, expand_to_tokens, gae_advantages, grpo_advantages, rloo_advantages
from asyncrl.train.config import AdvantageConfig, Estimator
from asyncrl.train.reward_shaping import (
    handle_truncated,
    outcome_token_rewards,
    overlong_penalty,
    shape_rewards,
)


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def flat(x):
    return x.flatten().tolist()


# --- group estimators -------------------------------------------------------------------------


def test_grpo_mean_std_in_group_rows_layout():
    adv = grpo_advantages(t([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    a = 0.5 / (std + 1e-6)
    assert flat(adv) == pytest.approx([a, -a, -a, a, 0, 0, 0, 0], abs=1e-6)


def test_grpo_with_arbitrary_group_ids_and_singletons():
    rewards = t([2.0, 1.0, 4.0, 7.0, 3.0])
    groups = torch.tensor([42, 7, 42, 99, 7])  # groups {2, 4}, {1, 3}, singleton {7}
    adv = grpo_advantages(rewards, groups, eps=0.0)
    s1 = math.sqrt(2.0)  # unbiased std of [2, 4] and of [1, 3]
    assert flat(adv) == pytest.approx([-1 / s1, -1 / s1, 1 / s1, 0.0, 1 / s1], abs=1e-6)


def test_rloo_leaves_one_out():
    adv = rloo_advantages(t([1.0, 0.0, 0.0, 1.0, 5.0]), torch.tensor([0, 0, 0, 0, 1]))
    # 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3; a group of one gets 0.
    assert flat(adv) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0], abs=1e-6)


def test_drgrpo_subtracts_group_mean_only():
    adv = drgrpo_advantages(t([[1.0, 0.0, 0.0, 0.0], [3.0, 5.0, 4.0, 4.0]]))
    assert flat(adv) == pytest.approx([0.75, -0.25, -0.25, -0.25, -1.0, 1.0, 0.0, 0.0])


def test_reinforce_pp_normalises_over_the_batch():
    adv = batch_normalized_advantages(t([1.0, 2.0, 3.0, 6.0]), eps=0.0)
    std = math.sqrt((4 + 1 + 0 + 9) / 3)  # mean 3
    assert flat(adv) == pytest.approx([-2 / std, -1 / std, 0.0, 3 / std], abs=1e-6)


def test_group_ids_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="group_ids shape"):
        grpo_advantages(t([1.0, 2.0]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="need group_ids"):
        rloo_advantages(t([1.0, 2.0]))


# --- GAE --------------------------------------------------------------------------------------


def test_gae_three_steps_by_hand_with_prompt_gap_and_padding():
    gamma, lam = 0.9, 0.8
    # delta2 = 1 - 0.7 = 0.3;           A2 = 0.3
    # delta1 = 0.9 * 0.7 - 0.6 = 0.03;  A1 = 0.03 + 0.72 * 0.3 = 0.246
    # delta0 = 0.9 * 0.6 - 0.5 = 0.04;  A0 = 0.04 + 0.72 * 0.246 = 0.21712
    a = [0.21712, 0.246, 0.3]
    ret = [0.21712 + 0.5, 0.246 + 0.6, 0.3 + 0.7]
    # Row 0: [prompt, a0, a1, tool token, a2, pad]; row 1: the same actions right-aligned-left.
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 1, 0, 0, 0]])
    rewards = t([[5.0, 0.0, 0.0, 5.0, 1.0, 5.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    values = t([[99.0, 0.5, 0.6, 99.0, 0.7, 99.0], [0.5, 0.6, 0.7, 99.0, 99.0, 99.0]])
    adv, returns = gae_advantages(rewards, values, mask, gamma, lam)
    assert flat(adv) == pytest.approx(
        [0, a[0], a[1], 0, a[2], 0, a[0], a[1], a[2], 0, 0, 0], abs=1e-6
    )
    assert flat(returns) == pytest.approx(
        [0, ret[0], ret[1], 0, ret[2], 0, ret[0], ret[1], ret[2], 0, 0, 0], abs=1e-6
    )


def test_gae_with_lambda_one_and_gamma_one_is_return_minus_value():
    rewards, values = t([[0.0, 0.0, 2.0]]), t([[0.5, 1.0, 1.5]])
    adv, returns = gae_advantages(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    assert flat(adv) == pytest.approx([1.5, 1.0, 0.5])
    assert flat(returns) == pytest.approx([2.0, 2.0, 2.0])


def test_compute_advantages_gae_puts_outcome_on_last_token_and_adds_dense_rewards():
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    values = t([[0.0, 0.5, 0.6, 0.7, 0.0]])
    dense = t([[0.0, 0.0, 0.0, -0.1, 0.0]])  # e.g. a KL reward on the last action
    cfg = AdvantageConfig(estimator="gae", gamma=0.9, lam=0.8)
    inputs = AdvantageInputs(t([1.1]), mask, values=values, token_rewards=dense)
    res = compute_advantages(inputs, cfg)
    assert flat(res.advantages) == pytest.approx([0, 0.21712, 0.246, 0.3, 0], abs=1e-6)
    assert res.returns is not None
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages(AdvantageInputs(t([1.0]), mask), cfg)


def test_gae_bootstraps_a_truncated_row_from_the_value_after_its_last_token():
    """AReaL's convention: a row cut at the length limit did not end, so the step after its last
    action is worth V(state after it), not 0; a row that stopped keeps value 0 there."""
    gamma, lam = 0.9, 0.8
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    values = t([[0.0, 0.5, 0.6], [0.0, 0.5, 0.6]])
    rewards = t([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    # row 0 (truncated, V_end = 0.4): delta1 = 1 + 0.9 * 0.4 - 0.6 = 0.76; A1 = 0.76
    #   delta0 = 0.9 * 0.6 - 0.5 = 0.04; A0 = 0.04 + 0.72 * 0.76 = 0.5872
    # row 1 (stopped): delta1 = 1 - 0.6 = 0.4; A0 = 0.04 + 0.72 * 0.4 = 0.328
    adv, returns = gae_advantages(rewards, values, mask, gamma, lam, t([0.4, 0.0]))
    assert flat(adv) == pytest.approx([0, 0.5872, 0.76, 0, 0.328, 0.4], abs=1e-6)
    assert flat(returns) == pytest.approx([0, 1.0872, 1.36, 0, 0.828, 1.0], abs=1e-6)
    cfg = AdvantageConfig(estimator="gae", gamma=gamma, lam=lam, truncated_bootstrap=True)
    # compute_advantages uses the end value of truncated rows only (row 1's 9.0 is ignored)
    res = compute_advantages(AdvantageInputs(
        t([1.0, 1.0]), mask, values=values, truncated=torch.tensor([True, False]),
        end_values=t([0.4, 9.0])), cfg)
    assert flat(res.advantages) == pytest.approx([0, 0.5872, 0.76, 0, 0.328, 0.4], abs=1e-6)
    # without the option both rows end: row 0 as row 1
    res = compute_advantages(AdvantageInputs(
        t([1.0, 1.0]), mask, values=values, truncated=torch.tensor([True, False]),
        end_values=t([0.4, 9.0])), AdvantageConfig(estimator="gae", gamma=gamma, lam=lam))
    assert flat(res.advantages) == pytest.approx([0, 0.328, 0.4, 0, 0.328, 0.4], abs=1e-6)
    with pytest.raises(ValueError, match="needs end_values"):
        compute_advantages(AdvantageInputs(t([1.0, 1.0]), mask, values=values,
                                           truncated=torch.tensor([True, False])), cfg)


def test_truncated_bootstrap_is_refused_where_it_cannot_act():
    with pytest.raises(ValueError, match="estimator='gae' only"):
        AdvantageConfig(estimator="grpo", truncated_bootstrap=True)
    with pytest.raises(ValueError, match="changes nothing"):
        AdvantageConfig(estimator="gae", truncated_bootstrap=True, truncated="mask_loss")
    AdvantageConfig(estimator="gae", truncated_bootstrap=True, truncated="zero_reward")


# --- reward shaping ---------------------------------------------------------------------------


def test_reward_scale_bias_clip():
    shaped = shape_rewards(t([3.0, -5.0, 0.5]), scale=2.0, bias=1.0, clip=3.0)
    # (3-1)*2 = 4 -> 3; (-5-1)*2 = -12 -> -3; (0.5-1)*2 = -1
    assert flat(shaped) == pytest.approx([3.0, -3.0, -1.0])
    assert flat(shape_rewards(t([3.0]), scale=2.0, bias=1.0)) == [4.0]


def test_overlong_penalty_at_the_boundaries():
    # max_len 20, buffer 4: free up to 16, then -1/4 per token, -1 at 20 and beyond.
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    assert flat(overlong_penalty(lengths, 20, 4)) == pytest.approx([0, 0, -0.25, -0.5, -1, -1])
    with pytest.raises(ValueError, match="overlong_buffer_len=30"):
        overlong_penalty(lengths, 20, 30)


def test_truncated_sequences_masked_or_zeroed():
    rewards, mask = t([1.0, 1.0]), torch.ones(2, 3, dtype=torch.long)
    truncated = torch.tensor([True, False])
    r, m = handle_truncated(rewards, mask, truncated, "mask_loss")
    assert flat(r) == [1.0, 1.0] and m.tolist() == [[0, 0, 0], [1, 1, 1]]
    r, m = handle_truncated(rewards, mask, truncated, "zero_reward")
    assert flat(r) == [0.0, 1.0] and m.tolist() == [[1, 1, 1], [1, 1, 1]]
    r, m = handle_truncated(rewards, mask, truncated, "keep")
    assert flat(r) == [1.0, 1.0] and m.tolist() == [[1, 1, 1], [1, 1, 1]]


def test_outcome_reward_lands_on_last_generated_token_and_expands():
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert outcome_token_rewards(t([2.0, 3.0, 4.0]), mask).tolist() == [
        [0, 0, 2, 0], [3, 0, 0, 0], [0, 0, 0, 0]
    ]
    assert expand_to_tokens(t([2.0, 3.0, 4.0]), mask).tolist() == [
        [0, 2, 2, 0], [3, 0, 0, 0], [0, 0, 0, 0]
    ]


def test_compute_advantages_applies_shaping_truncation_and_penalty_in_order():
    cfg = AdvantageConfig(
        estimator="drgrpo", reward_scale=2.0, reward_bias=0.5, reward_clip=1.0,
        overlong_buffer_len=2, overlong_max_len=4, truncated="mask_loss",
    )
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    inputs = AdvantageInputs(
        rewards=t([1.0, 0.0, 1.0]), loss_mask=mask, group_ids=torch.tensor([0, 0, 0]),
        truncated=torch.tensor([False, False, True]),
    )
    res = compute_advantages(inputs, cfg)
    # shaped: (1-0.5)*2 = 1, (0-0.5)*2 = -1, 1; penalty(L=2,3,4) = 0, -0.5, -1
    final = [1.0, -1.5, 0.0]
    assert flat(res.rewards) == pytest.approx(final)
    mean = sum(final) / 3
    a = [r - mean for r in final]
    # The truncated row stays in the group mean but gets no loss tokens.
    assert res.loss_mask[2].tolist() == [0, 0, 0, 0]
    assert flat(res.advantages) == pytest.approx(
        [a[0], a[0], 0, 0, a[1], a[1], a[1], 0, 0, 0, 0, 0]
    )
    assert res.stats["adv/truncated_frac"] == pytest.approx(1 / 3)
    assert res.stats["adv/overlong_penalty_mean"] == pytest.approx(-0.5)


@pytest.mark.parametrize(
    "estimator, expected",
    # rewards [1, 0]: mean 0.5, unbiased std sqrt(0.5); one group, so group == batch statistics.
    [("grpo", [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)]),
     ("rloo", [1.0, -1.0]),
     ("drgrpo", [0.5, -0.5]),
     ("reinforce_pp", [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)])],
)
def test_every_sequence_estimator_through_compute_advantages(estimator, expected):
    inputs = AdvantageInputs(t([1.0, 0.0]), torch.ones(2, 1), group_ids=torch.tensor([3, 3]))
    res = compute_advantages(inputs, AdvantageConfig(estimator=estimator, std_eps=1e-9))
    assert flat(res.advantages) == pytest.approx(expected, abs=1e-6)
    assert res.returns is None


def test_estimator_table_covers_the_literal_and_errors_are_named():
    assert set(ESTIMATORS) == set(typing.get_args(Estimator))
    mask = torch.ones(2, 1)
    with pytest.raises(ValueError, match="needs group_ids"):
        compute_advantages(AdvantageInputs(t([1.0, 0.0]), mask), AdvantageConfig())
    with pytest.raises(ValueError, match="token_rewards"):
        dense = torch.zeros(2, 1)
        inputs = AdvantageInputs(t([1.0, 0.0]), mask, torch.tensor([0, 0]), token_rewards=dense)
        compute_advantages(inputs, AdvantageConfig())


def test_advantage_config_validation():
    with pytest.raises(ConfigError, match="overlong_buffer_len=4 needs overlong_max_len"):
        AdvantageConfig.from_dict({"overlong_buffer_len": 4})
    too_big = r"overlong_buffer_len=8 is out of range; allowed \[1, overlong_max_len=4\]"
    with pytest.raises(ConfigError, match=too_big):
        AdvantageConfig.from_dict({"overlong_buffer_len": 8, "overlong_max_len": 4})
    with pytest.raises(ConfigError, match="estimator='ppo'"):
        AdvantageConfig.from_dict({"estimator": "ppo"})
    with pytest.raises(ConfigError, match="gamma=1.5"):
        AdvantageConfig.from_dict({"gamma": 1.5})


def test_grpo_singleton_group_zero_or_verls_raw_by_hand():
    rewards, ids = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([7, 7, 9])
    zero = grpo_advantages(rewards, ids, eps=0.5)
    # group 7: mean 0.5, unbiased std 0.7071 -> +-0.5 / 1.2071; group 9 alone: 0
    assert zero.tolist() == pytest.approx([0.5 / 1.2071068, -0.5 / 1.2071068, 0.0])
    raw = grpo_advantages(rewards, ids, eps=0.5, singleton="raw")
    assert raw.tolist() == pytest.approx([0.5 / 1.2071068, -0.5 / 1.2071068, 2.0 / 1.5])


def test_token_whitening_by_hand():
    from asyncrl.train.advantages import whiten_tokens

    adv = torch.tensor([[1.0, 1.0, 9.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # tokens 1, 1, 4: mean 2, unbiased var (1 + 1 + 4) / 2 = 3
    out = whiten_tokens(adv, mask, eps=0.0)
    s = math.sqrt(3.0)
    torch.testing.assert_close(out, torch.tensor([[-1 / s, -1 / s, 0.0], [2 / s, 0.0, 0.0]]))


def test_reinforce_pp_baseline_and_whiten_through_compute_advantages():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    ids = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]])
    inputs = AdvantageInputs(rewards, mask, group_ids=ids)
    got = compute_advantages(inputs, AdvantageConfig(estimator="reinforce_pp_baseline",
                                                     whiten_eps=1e-12)).advantages
    # r - group mean: 0.5, -0.5, 1, -1; on tokens: 0.5, 0.5, -0.5, 1, -1, -1 (mean 0.25/6)
    toks = torch.tensor([0.5, 0.5, -0.5, 1.0, -1.0, -1.0])
    mean, std = toks.mean(), toks.std()
    want = [[(0.5 - mean) / std, (0.5 - mean) / std], [(-0.5 - mean) / std, 0.0],
            [(1.0 - mean) / std, 0.0], [(-1.0 - mean) / std, (-1.0 - mean) / std]]
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=0)
    # whiten after grpo: the token advantages have mean 0 and unit (unbiased) std
    w = compute_advantages(inputs, AdvantageConfig(whiten=True)).advantages
    on = w[mask.bool()]
    assert float(on.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(on.std()) == pytest.approx(1.0, abs=1e-5)


def test_conventions_that_do_not_fit_are_refused_at_load():
    with pytest.raises(ValueError, match="singleton_group"):
        AdvantageConfig(estimator="rloo", singleton_group="raw")
    with pytest.raises(ValueError, match="already whitens"):
        AdvantageConfig(estimator="reinforce_pp_baseline", whiten=True)
