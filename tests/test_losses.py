"""Policy / critic losses, regularisers and proximal logprobs against hand-computed numbers.

Expected values are written with plain `math` in the tests, never by calling the function under
test, so a wrong formula cannot agree with itself.
"""

import math

import pytest
import torch

from asyncrl.config import ConfigError
from asyncrl.train.aggregation import aggregate, normalizer_count, normalizer_unit
from asyncrl.train.losses import critic_value_loss, ppo_actor_loss, sft_loss
from asyncrl.train.config import PPOLossConfig
from asyncrl.train.proximal import approx_proximal_logprobs, proximal_logprobs
from asyncrl.train.config import ProximalConfig
from asyncrl.train.regularizers import entropy_from_logits, kl_penalty, kl_reward

F64 = torch.float64


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def ones_like_mask(x):
    return torch.ones_like(x, dtype=torch.bool)


def ratio_case(ratios, adv, cfg, prox_equals_behav=True):
    """PPO loss on tokens with given ratios (prox = behav = 0) -> (loss, stats, grad)."""
    lp = torch.tensor([math.log(r) for r in ratios], dtype=F64, requires_grad=True)
    zeros = torch.zeros(len(ratios), dtype=F64)
    adv_t = t(adv)
    loss, stats = ppo_actor_loss(lp, zeros, zeros, adv_t, ones_like_mask(zeros), len(ratios), cfg)
    loss.backward()
    return loss.item(), stats, lp.grad.tolist()


# --- PPO clip ---------------------------------------------------------------------------------


def test_clip_positive_advantage_uses_upper_bound_only():
    cfg = PPOLossConfig(eps_clip=0.2, eps_clip_higher=0.28)
    ratios = [0.7, 1.0, 1.279, 1.281, 1.5]
    loss, stats, grad = ratio_case(ratios, [1.0] * 5, cfg)
    # A > 0: loss = -min(r, clip(r)); the lower bound never binds, the upper binds above 1.28.
    per_tok = [-0.7, -1.0, -1.279, -1.28, -1.28]
    assert loss == pytest.approx(sum(per_tok) / 5, abs=1e-12)
    # d(-r)/d(log r) = -r where unclipped, 0 where the clipped constant is taken.
    assert grad == pytest.approx([-0.7 / 5, -1.0 / 5, -1.279 / 5, 0.0, 0.0], abs=1e-12)
    assert stats["ppo/clip_frac"] == pytest.approx(2 / 5)


def test_clip_negative_advantage_uses_lower_bound_only():
    cfg = PPOLossConfig(eps_clip=0.2, eps_clip_higher=0.28)
    ratios = [0.5, 0.799, 0.801, 1.0, 1.5]
    loss, stats, grad = ratio_case(ratios, [-2.0] * 5, cfg)
    # A = -2: loss = -min(-2r, -2 clip(r)) = 2 max(r, clip(r)); binds below 0.8 only.
    per_tok = [1.6, 1.6, 2 * 0.801, 2.0, 3.0]
    assert loss == pytest.approx(sum(per_tok) / 5, abs=1e-12)
    assert grad == pytest.approx([0.0, 0.0, 2 * 0.801 / 5, 2.0 / 5, 3.0 / 5], abs=1e-12)
    assert stats["ppo/clip_frac"] == pytest.approx(2 / 5)


def test_clip_value_is_continuous_at_both_boundaries():
    cfg = PPOLossConfig(eps_clip=0.2, eps_clip_higher=0.28)
    loss_hi, _, _ = ratio_case([1.28], [1.0], cfg)
    loss_lo, _, _ = ratio_case([0.8], [-1.0], cfg)
    assert loss_hi == pytest.approx(-1.28, abs=1e-12)
    assert loss_lo == pytest.approx(0.8, abs=1e-12)


def test_clip_higher_defaults_to_eps_clip():
    cfg = PPOLossConfig(eps_clip=0.2)
    loss, _, grad = ratio_case([1.25], [1.0], cfg)
    assert loss == pytest.approx(-1.2, abs=1e-12)
    assert grad == [0.0]


def test_dual_clip_caps_negative_advantage_loss():
    cfg = PPOLossConfig(eps_clip=0.2, c_clip=3.0)
    ratios = [4.0, 2.0, 4.0]
    adv = [-1.0, -1.0, 1.0]
    loss, stats, grad = ratio_case(ratios, adv, cfg)
    # A=-1, r=4: 1*max(4, 1.2) = 4 > c*|A| = 3 -> 3 (constant, no grad);
    # A=-1, r=2: 2 < 3 -> 2, grad r; A=+1, r=4: ordinary clip -> -1.2, no grad.
    assert loss == pytest.approx((3.0 + 2.0 - 1.2) / 3, abs=1e-12)
    assert grad == pytest.approx([0.0, 2.0 / 3, 0.0], abs=1e-12)
    assert stats["ppo/dual_clip_frac"] == pytest.approx(1 / 3)
    assert stats["ppo/ratio_mean"] == pytest.approx((4.0 + 2.0 + 4.0) / 3)
    # k3 of KL(prox || new) with prox = 0: mean of r - 1 - log r.
    kl = sum(r - 1 - math.log(r) for r in ratios) / 3
    assert stats["ppo/approx_kl"] == pytest.approx(kl)


# --- decoupled objective ----------------------------------------------------------------------


def test_decoupled_equals_standard_ppo_when_proximal_is_behaviour():
    torch.manual_seed(0)
    lp = (torch.randn(2, 4, dtype=F64) * 0.3).requires_grad_()
    old = torch.randn(2, 4, dtype=F64) * 0.3
    adv = torch.randn(2, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    cfg = PPOLossConfig(eps_clip=0.2, behav_imp_weight_cap=2.0)
    loss, stats = ppo_actor_loss(lp, old, old, adv, mask, 6, cfg)
    expected = 0.0
    for i in range(2):
        for j in range(4):
            if mask[i, j]:
                r = math.exp(lp[i, j].item() - old[i, j].item())
                a = adv[i, j].item()
                expected += -min(r * a, min(max(r, 0.8), 1.2) * a)
    assert loss.item() == pytest.approx(expected / 6, abs=1e-12)
    assert stats["ppo/behav_weight_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("mode, kept", [("cap", [0.5, 2.0, 3.0]), ("mask", [0.5, 2.0, 0.0])])
def test_behaviour_weight_cap_vs_mask(mode, kept):
    weights = [0.5, 2.0, 4.0]
    prox = t([math.log(w) for w in weights])
    behav = torch.zeros(3, dtype=F64)
    lp = prox.clone().requires_grad_()  # ratio 1: the loss is -A * w
    cfg = PPOLossConfig(behav_imp_weight_cap=3.0, behav_imp_weight_mode=mode)
    loss, stats = ppo_actor_loss(lp, prox, behav, t([1.0] * 3), ones_like_mask(prox), 3, cfg)
    loss.backward()
    assert loss.item() == pytest.approx(-sum(kept) / 3, abs=1e-12)
    assert lp.grad.tolist() == pytest.approx([-w / 3 for w in kept], abs=1e-12)
    assert stats["ppo/behav_weight_max"] == pytest.approx(max(kept))
    assert stats["ppo/behav_over_cap_frac"] == pytest.approx(1 / 3)
    assert stats["ppo/behav_masked_frac"] == pytest.approx(1 / 3 if mode == "mask" else 0.0)


def test_uncapped_behaviour_weight_is_the_raw_ratio():
    prox, behav = t([math.log(5.0)]), t([0.0])
    lp = prox.clone().requires_grad_()
    loss, _ = ppo_actor_loss(lp, prox, behav, t([1.0]), ones_like_mask(prox), 1, PPOLossConfig())
    assert loss.item() == pytest.approx(-5.0)


# --- GSPO sequence ratio and aggregation ------------------------------------------------------


def test_sequence_level_ratio_is_geometric_mean_per_sequence():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    prox = torch.zeros(2, 3, dtype=F64)
    # Row 1's padding holds a huge logprob that must not leak into the ratio.
    lp = t([[0.1, 0.2, 0.3], [-0.1, 0.0, 50.0]]).requires_grad_()
    cfg = PPOLossConfig(eps_clip=0.2, ratio_level="sequence", loss_agg="seq_mean_token_mean")
    loss, _ = ppo_actor_loss(lp, prox, prox, torch.ones(2, 3, dtype=F64), mask, 2, cfg)
    loss.backward()
    s0, s1 = math.exp(0.2), math.exp(-0.05)  # exp(mean log-ratio)
    assert s0 > 1.2  # row 0 clipped to 1.2
    assert loss.item() == pytest.approx((-1.2 - s1) / 2, abs=1e-12)
    # Row 1: d(-s1)/d lp_t = -s1 * 1/2 (mean over 2 tokens); the seq mean /2 and normaliser /2.
    g1 = -s1 / 2 / 2
    assert lp.grad.flatten().tolist() == pytest.approx([0, 0, 0, g1, g1, 0], abs=1e-12)


def unit_ratio_loss(adv, mask, agg, normalizer):
    zeros = torch.zeros_like(adv)
    cfg = PPOLossConfig(loss_agg=agg)
    return ppo_actor_loss(zeros, zeros, zeros, adv, mask, normalizer, cfg)[0].item()


def test_token_vs_sequence_aggregation():
    adv = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    # Per-token loss is -A (ratio 1); row 2 has no loss tokens and counts nowhere.
    assert normalizer_count(mask, normalizer_unit("token_mean")).item() == 4
    assert normalizer_count(mask, normalizer_unit("seq_mean_token_mean")).item() == 2
    assert unit_ratio_loss(adv, mask, "token_mean", 4) == pytest.approx(-(1 + 2 + 3 + 4) / 4)
    assert unit_ratio_loss(adv, mask, "seq_mean_token_mean", 2) == pytest.approx(-(2 + 4) / 2)
    assert unit_ratio_loss(adv, mask, "seq_mean_token_sum", 2) == pytest.approx(-(6 + 4) / 2)


def test_token_mean_accepts_packed_tokens_and_sequence_modes_refuse_them():
    adv, mask = t([1.0, 2.0, 3.0]), torch.tensor([1, 0, 1], dtype=torch.bool)
    assert unit_ratio_loss(adv, mask, "token_mean", 2) == pytest.approx(-2.0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        unit_ratio_loss(adv, mask, "seq_mean_token_mean", 2)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batches_with_global_normalizer_equal_one_big_batch(agg, level):
    torch.manual_seed(1)
    shape = (4, 6)
    lp = (torch.randn(shape, dtype=F64) * 0.4).requires_grad_()
    prox = torch.randn(shape, dtype=F64) * 0.4
    behav = prox + torch.randn(shape, dtype=F64) * 0.5
    adv = torch.randn(shape, dtype=F64)
    lengths = [6, 2, 4, 1]
    mask = torch.arange(6).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    cfg = PPOLossConfig(
        eps_clip_higher=0.3, c_clip=2.0, behav_imp_weight_cap=1.5, ratio_level=level, loss_agg=agg
    )
    norm = normalizer_count(mask, normalizer_unit(agg))
    full, _ = ppo_actor_loss(lp, prox, behav, adv, mask, norm, cfg)
    (full_grad,) = torch.autograd.grad(full, lp)
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4)):
        part, _ = ppo_actor_loss(
            lp[rows], prox[rows], behav[rows], adv[rows], mask[rows], norm, cfg
        )
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(lp.grad, full_grad, rtol=0, atol=1e-12)


def test_padding_garbage_cannot_make_loss_or_grad_nan():
    lp = t([[0.0, 1e4], [0.1, float("inf")]]).requires_grad_()
    prox = t([[0.0, -1e4], [0.0, 0.0]])
    mask = torch.tensor([[1, 0], [1, 0]], dtype=torch.bool)
    loss, _ = ppo_actor_loss(lp, prox, prox, torch.ones(2, 2, dtype=F64), mask, 2, PPOLossConfig())
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(lp.grad).all() and lp.grad[:, 1].abs().sum() == 0


# --- regularisers, actor loss, GRPO, critic, SFT -----------------------------------------------


def test_kl_estimators_by_hand():
    lp, ref = t([0.5, -0.5]).requires_grad_(), t([0.0, 0.0])
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx([0.5, -0.5])
    assert kl_penalty(lp, ref, "k2").tolist() == pytest.approx([0.125, 0.125])
    k3 = kl_penalty(lp, ref, "k3")
    assert k3.tolist() == pytest.approx([math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5])
    k3.sum().backward()  # d/dx (e^-x - 1 + x) = 1 - e^-x
    assert lp.grad.tolist() == pytest.approx([1 - math.exp(-0.5), 1 - math.exp(0.5)])
    with pytest.raises(ValueError, match="kl_kind='k4'"):
        kl_penalty(lp, ref, "k4")


def test_kl_reward_is_detached_and_only_on_loss_tokens():
    lp = t([0.5, 0.5]).requires_grad_()
    out = kl_reward(t([1.0, 1.0]), lp, t([0.0, 0.0]), torch.tensor([1, 0]), 0.1, "k2")
    assert out.tolist() == pytest.approx([1.0 - 0.1 * 0.125, 1.0])
    assert not out.requires_grad


def test_entropy_of_uniform_is_log_vocab_and_of_known_distribution():
    assert entropy_from_logits(torch.zeros(2, 3, 7)).flatten().tolist() == pytest.approx(
        [math.log(7)] * 6, abs=1e-6
    )
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    assert entropy_from_logits(logits).item() == pytest.approx(1.5 * math.log(2), abs=1e-6)
    # Temperature 2 on logits [2 ln 2, 0] gives probs [2/3, 1/3].
    hot = entropy_from_logits(torch.tensor([2 * math.log(2), 0.0]), temperature=2.0)
    expected = -(2 / 3) * math.log(2 / 3) - (1 / 3) * math.log(1 / 3)
    assert hot.item() == pytest.approx(expected, abs=1e-6)


def test_actor_loss_adds_entropy_bonus_and_kl_term():
    zeros = torch.zeros(2, dtype=F64)
    lp = t([0.2, -0.2]).requires_grad_()
    mask = torch.ones(2, dtype=torch.bool)
    cfg = PPOLossConfig(eps_clip=0.5, entropy_coef=0.01, kl_coef=0.1, kl_kind="k2", kl_as="loss")
    entropy = t([1.0, 3.0])
    loss, stats = ppo_actor_loss(lp, zeros, zeros, t([1.0, 1.0]), mask, 2, cfg, entropy, zeros)
    pg = -(math.exp(0.2) + math.exp(-0.2)) / 2
    kl = (0.5 * 0.04 + 0.5 * 0.04) / 2
    assert loss.item() == pytest.approx(pg - 0.01 * 2.0 + 0.1 * kl, abs=1e-12)
    assert stats["actor/entropy"] == pytest.approx(2.0)
    assert stats["actor/kl_ref"] == pytest.approx(0.02)
    with pytest.raises(ValueError, match="entropy_coef"):
        ppo_actor_loss(lp, zeros, zeros, zeros, mask, 2, cfg, None, zeros)
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_actor_loss(lp, zeros, zeros, zeros, mask, 2, cfg, entropy, None)
    # kl_as="reward" leaves the KL to the advantage stage: no reference needed here.
    reward_cfg = cfg.model_copy(update={"kl_as": "reward", "entropy_coef": 0.0})
    plain, _ = ppo_actor_loss(lp, zeros, zeros, t([1.0, 1.0]), mask, 2, reward_cfg)
    assert plain.item() == pytest.approx(pg, abs=1e-12)


def test_critic_value_loss_clipping_by_hand():
    values = t([1.5, 1.1, 0.5]).requires_grad_()
    old, returns = t([1.0, 1.0, 1.0]), t([2.0, 2.0, 2.0])
    loss, stats = critic_value_loss(values, old, returns, torch.ones(3), 3, value_eps_clip=0.2)
    loss.backward()
    # 1.5: clip to 1.2, (1.2-2)^2=0.64 > 0.25 -> clipped (no grad); 1.1: inside, 0.81;
    # 0.5: clip to 0.8, 1.44 < 2.25 -> unclipped.
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 2.25) / 3, abs=1e-12)
    assert values.grad.tolist() == pytest.approx([0.0, (1.1 - 2) / 3, (0.5 - 2) / 3], abs=1e-12)
    assert stats["critic/clip_frac"] == pytest.approx(1 / 3)
    unclipped, _ = critic_value_loss(values, old, returns, torch.ones(3), 3, value_eps_clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (0.25 + 0.81 + 2.25) / 3, abs=1e-12)
    with pytest.raises(ValueError, match="value_eps_clip=0"):
        critic_value_loss(values, old, returns, torch.ones(3), 3, value_eps_clip=0)


def test_sft_loss_unchanged():
    loss, stats = sft_loss(t([[-1.0, -2.0], [-3.0, -4.0]]), torch.tensor([[1, 1], [0, 1]]), 3)
    assert loss.item() == pytest.approx(7 / 3)
    assert stats["sft/tokens"] == 3


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="loss_agg='mean'"):
        aggregate(torch.zeros(2, 2), torch.ones(2, 2), 1, "mean")


# --- config validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, bound",
    [("c_clip", 0.5, "greater than 1"), ("behav_imp_weight_cap", 1.0, "greater than 1"),
     ("eps_clip", 1.5, "less than 1"), ("entropy_coef", -0.1, "greater than or equal to 0")],
)
def test_ppo_config_errors_name_field_value_and_range(field, value, bound):
    with pytest.raises(ValueError) as err:
        PPOLossConfig(**{field: value})
    assert field in str(err.value) and str(value) in str(err.value) and bound in str(err.value)
    with pytest.raises(ConfigError, match=f"{field}={value}: Input should be {bound}"):
        PPOLossConfig.from_dict({field: value})


def test_ppo_config_rejects_unknown_literal_and_key():
    with pytest.raises(ConfigError, match="loss_agg='mean'"):
        PPOLossConfig.from_dict({"loss_agg": "mean"})
    with pytest.raises(ConfigError, match="did you mean 'c_clip'"):
        PPOLossConfig.from_dict({"c_clp": 3})


# --- proximal logprobs ------------------------------------------------------------------------


def test_loglinear_proximal_by_version_gap():
    v = 10
    behav = t([-2.0, -2.0, -2.0, -2.0, 0.0])
    current = t([-1.0, -1.0, -1.0, -1.0, -1.0])
    versions = torch.tensor([v, v - 1, v - 2, v - 3, -1])
    prox = approx_proximal_logprobs(behav, current, versions, v)
    # Proximal = version V-1. v_b = V: fresh, keep behaviour; v_b = V-1: behaviour *is* V-1;
    # v_b = V-2: alpha = 1/2 (midpoint); v_b = V-3: alpha = 2/3; prompt: untouched behaviour.
    assert prox.tolist() == pytest.approx([-2.0, -2.0, -1.5, -2.0 + 2 / 3, 0.0])


def test_proximal_sources():
    behav, current = t([-2.0, -2.0]), t([-1.0, -1.0]).requires_grad_()
    versions = torch.tensor([4, 3])
    behaviour_cfg = ProximalConfig(proximal_logprobs="behaviour")
    assert proximal_logprobs(behaviour_cfg, behav).tolist() == [-2, -2]
    assert not behaviour_cfg.needs_forward_pass
    loglinear_cfg = ProximalConfig(proximal_logprobs="loglinear")
    loglin = proximal_logprobs(loglinear_cfg, behav, current, versions, 5)
    assert loglin.tolist() == pytest.approx([-2.0, -1.5]) and not loglin.requires_grad
    recompute = ProximalConfig(proximal_logprobs="recompute")
    assert ProximalConfig().proximal_logprobs == "loglinear"  # the default (README: why)
    assert recompute.needs_forward_pass
    assert proximal_logprobs(recompute, behav, recomputed=t([-0.5, -0.5])).tolist() == [-0.5, -0.5]
    with pytest.raises(ValueError, match="recompute"):
        proximal_logprobs(recompute, behav)
    with pytest.raises(ValueError, match="current_version"):
        proximal_logprobs(loglinear_cfg, behav)
    with pytest.raises(ConfigError, match="proximal_logprobs='exact'"):
        ProximalConfig.from_dict({"proximal_logprobs": "exact"})
