"""Every loss option in the packed trainer: GSPO's sequence ratio, the three aggregation modes,
the entropy bonus, and the off-policy corrections (truncated / masked / IcePop, token and
sequence level, CISPO). Hand-computed values for the pure functions; packed == padded for the
loss; micro-batching == one big batch for the sequence normaliser; a few real training steps
of each option through `Trainer`."""

import math

import pytest
import torch
from conftest import TINY
from test_train_loop import small_config
from train_helpers import digit_reward

from asyncrl import Trainer
from asyncrl.api.trajectory import Sample
from asyncrl.models.tiny import build_tiny_model
from asyncrl.train.aggregation import aggregate, per_sequence_mean, sequence_count
from asyncrl.train.corrections import (bound_weights, cispo_token_loss, icepop, log_weights,
                                       mask_above, truncate)
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.losses import ppo_actor_loss
from asyncrl.train.config import PPOLossConfig
from asyncrl.train.config import OptimizerConfig
from asyncrl.train.critic import load_critic
from asyncrl.train.parallel import SingleProcess
from asyncrl.train.checkpoint import load_state
from asyncrl.train.config import CriticConfig
from asyncrl.train.critic import ValueModel
from asyncrl.train.ppo_actor import PPOActor
from asyncrl.train.config import PPOActorConfig
from asyncrl.train.regularizers import entropy_from_logits

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- pure functions, hand-computed -------------------------------------------------------

def test_corrections_by_hand():
    w = torch.tensor([0.2, 0.9, 1.5, 4.0])
    m = torch.tensor([True, True, True, False])
    got, over = truncate(w, m, 2.0)
    assert got.tolist() == pytest.approx([0.2, 0.9, 1.5, 2.0]) and over.tolist() == [0, 0, 0, 0]
    got, out = mask_above(w, m, 1.2)
    assert got.tolist() == pytest.approx([0.2, 0.9, 0.0, 4.0]) and out.tolist() == [0, 0, 1, 0]
    got, out = icepop(w, m, 1.2, 0.5)
    assert got.tolist() == pytest.approx([0.0, 0.9, 0.0, 4.0]) and out.tolist() == [1, 0, 1, 0]
    got, _ = bound_weights(w, m, "icepop", 1.2)  # default floor 1 / cap
    assert got.tolist() == pytest.approx([0.0, 0.9, 0.0, 4.0])
    assert bound_weights(w, m, "cap", None)[0] is w


def test_no_behaviour_weight_by_hand():
    """behav_imp_weight=false: the clipped surrogate around the proximal policy, w = 1."""
    logp = torch.log(torch.tensor([[0.5, 0.3]]))
    prox = torch.log(torch.tensor([[0.4, 0.3]]))
    behav = torch.log(torch.tensor([[0.1, 0.6]]))  # w would be 4 and 0.5
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    cfg = PPOLossConfig(behav_imp_weight=False)
    loss, stats = ppo_actor_loss(logp, prox, behav, adv, mask, 2.0, cfg)
    # ratios 1.25 (clipped to 1.2 for A > 0) and 1.0: (-1.2 + 1.0) / 2
    assert float(loss) == pytest.approx((-1.2 + 1.0) / 2)
    assert stats["ppo/behav_weight_mean"] == 1.0
    weighted, _ = ppo_actor_loss(logp, prox, behav, adv, mask, 2.0, PPOLossConfig())
    assert float(weighted) == pytest.approx((-1.2 * 4 + 1.0 * 0.5) / 2)


def test_lower_truncation_product_weights_and_gspo_token_by_hand():
    w = torch.tensor([0.2, 0.9, 1.5, 4.0])
    m = torch.tensor([True, True, True, False])
    got, out = truncate(w, m, 2.0, 0.5)  # two-sided truncation
    assert got.tolist() == pytest.approx([0.5, 0.9, 1.5, 2.0]) and out.tolist() == [1, 0, 0, 0]
    got, out = mask_above(w, m, 1.2, 0.5)
    assert got.tolist() == pytest.approx([0.0, 0.9, 0.0, 4.0]) and out.tolist() == [1, 0, 1, 0]
    # sequence_product: the sum of each sequence's log weights, clamped to +-20
    log_w = torch.tensor([0.2, 0.4, 9.0, -0.6, 15.0, 15.0])
    mask = torch.tensor([True, True, False, True, True, True])
    seq_id = torch.tensor([0, 0, 0, 1, 2, 2])
    got = log_weights(log_w, mask, "sequence_product", seq_id)
    assert got.tolist() == pytest.approx([0.6, 0.6, 0.0, -0.6, 20.0, 20.0])
    padded = log_weights(torch.tensor([[0.2, 0.4, 9.0]]), torch.tensor([[True, True, False]]),
                         "sequence_product")
    assert padded.tolist() == [pytest.approx([0.6, 0.6, 0.0])]
    # GSPO-token: the sequence's mean as value, each token's own gradient
    x = torch.tensor([0.2, 0.4, 0.0, -0.6], requires_grad=True)
    m4, ids = torch.tensor([True, True, False, True]), torch.tensor([0, 0, 0, 1])
    a = torch.tensor([1.0, 3.0, 0.0, 5.0])
    tok = log_weights(x, m4, "sequence_token", ids)
    assert tok.tolist() == pytest.approx([0.3, 0.3, 0.0, -0.6])
    (tok * a).sum().backward()
    assert x.grad.tolist() == pytest.approx([1.0, 3.0, 0.0, 5.0])
    x.grad = None
    (log_weights(x, m4, "sequence", ids) * a).sum().backward()
    assert x.grad.tolist() == pytest.approx([2.0, 2.0, 0.0, 5.0])  # GSPO: the sequence's mean


def test_constant_normaliser_by_hand_and_split_into_micro_batches():
    from asyncrl.train.aggregation import aggregate, normalizer_count, normalizer_unit

    loss = torch.tensor([[1.0, 2.0, 9.0], [3.0, 0.0, 0.0], [4.0, 4.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]).bool()
    unit = normalizer_unit("seq_mean_token_sum_norm")
    n = normalizer_count(mask, unit)
    assert unit == "sequences" and int(n) == 3
    whole = aggregate(loss, mask, n, "seq_mean_token_sum_norm", horizon=4)
    assert float(whole) == pytest.approx((1 + 2 + 3 + 12) / (3 * 4))
    # TRL's dr_grpo: masked sum / (batch x max_completion_length), the same number; verl's
    # seq-mean-token-sum-norm: masked sum / horizon, the batch's sequence count times it
    masked = (loss * mask).sum()
    assert float(whole) == pytest.approx(float(masked / (loss.shape[0] * 4)))
    assert float(masked / 4) == pytest.approx(3 * float(whole))
    parts = sum(aggregate(loss[i:i + 1], mask[i:i + 1], n, "seq_mean_token_sum_norm",
                          horizon=4) for i in range(3))
    assert float(parts) == pytest.approx(float(whole))
    with pytest.raises(ValueError, match="horizon"):
        aggregate(loss, mask, n, "seq_mean_token_sum_norm")


def test_dppo_trust_region_by_hand():
    from asyncrl.train.corrections import dppo_token_loss

    prox = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    lp = torch.log(torch.tensor([0.8, 0.55, 0.1, 0.45])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    ratio = (lp - prox).exp()
    loss, out = dppo_token_loss(lp, prox, ratio, adv, 0.2, 0.2, "tv")
    # TV: 0.8 grew by 0.3 > 0.2 (A > 0): out; 0.55 in; 0.1 shrank by 0.4 (A < 0): out; 0.45 in
    assert out.tolist() == [True, False, True, False]
    assert loss.detach().tolist() == pytest.approx(
        [0.0, -1.1 * math.log(0.55), 0.0, 0.9 * math.log(0.45)])
    loss.sum().backward()  # the weight is a constant: d/dlp = -sg(r) * A on the kept tokens
    assert lp.grad.tolist() == pytest.approx([0.0, -1.1, 0.0, 0.9])
    capped, _ = dppo_token_loss(lp.detach(), prox, ratio.detach(), adv, 0.2, 0.2, "tv", 1.05)
    assert float(capped[1]) == pytest.approx(-1.05 * math.log(0.55))
    # binary KL(Bern(0.5) || Bern(0.8)) = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.2231 > 0.2: out
    _, out_kl = dppo_token_loss(lp.detach(), prox, ratio.detach(), adv, 0.2, 0.2, "kl")
    assert out_kl.tolist() == [True, False, True, False]
    _, loose = dppo_token_loss(lp.detach(), prox, ratio.detach(), adv, 0.6, 0.3, "kl")
    assert loose.tolist() == [False, False, False, False]  # KL(0.5 || 0.1) = 0.511 < 0.6


def test_icepop_renormalize_takes_dropped_tokens_out_of_the_loss_mask():
    """verl's IcePop: a token the two-sided bound drops leaves the normaliser too (it is taken
    out of the sample's loss mask before the step)."""
    import types

    from asyncrl.api.trajectory import Sample
    from asyncrl.train.config import PPOActorConfig

    cfg = PPOActorConfig.model_validate({"ppo": {
        "behav_imp_weight_cap": 2.0, "behav_imp_weight_mode": "icepop",
        "behav_imp_weight_renormalize": True}, "proximal": {"proximal_logprobs": "recompute"}})
    behaviour = [0.0, -1.0, -1.0, -1.0, -1.0]
    # w = exp(prox - behav): 1 (prompt), e^1.0 = 2.72 > 2 (drop), 1.0, e^-1 = 0.37 < 0.5 (drop), 1.1
    prox = torch.tensor([0.0, 0.0, -1.0, -2.0, -1.0 + math.log(1.1)])
    smp = Sample(input_ids=[1, 2, 3, 4, 5], loss_mask=[0, 1, 1, 1, 1], logprobs=behaviour,
                 versions=[-1, 0, 0, 0, 0], reward=1.0)
    stats = {}
    (out,) = PPOActor._drop_bounded_tokens(types.SimpleNamespace(cfg=cfg), [smp],
                                           {"proximal_logprobs": [prox]}, stats)
    assert out.loss_mask == [0, 0, 1, 0, 1] and stats["ppo/renormalized_dropped_tokens"] == 2.0
    with pytest.raises(ValueError, match="recompute"):
        PPOActorConfig.model_validate({"ppo": {"behav_imp_weight_cap": 2.0,
                                               "behav_imp_weight_mode": "mask",
                                               "behav_imp_weight_renormalize": True},
                                       "proximal": {"proximal_logprobs": "loglinear"}})
    with pytest.raises(ValueError, match="mask or icepop"):
        PPOLossConfig(behav_imp_weight_cap=2.0, behav_imp_weight_renormalize=True)


def test_sequence_level_weight_is_the_geometric_mean_packed_and_padded():
    # two sequences: log w (0.2, 0.4) and (-0.6,); the third token is padding / prompt
    log_w = torch.tensor([0.2, 0.4, 9.0, -0.6])
    mask = torch.tensor([True, True, False, True])
    seq_id = torch.tensor([0, 0, 0, 1])
    got = log_weights(log_w, mask, "sequence", seq_id)
    assert got.tolist() == pytest.approx([0.3, 0.3, 0.3, -0.6])
    padded = log_weights(torch.tensor([[0.2, 0.4, 9.0], [-0.6, 0.0, 0.0]]),
                         torch.tensor([[True, True, False], [True, False, False]]), "sequence")
    assert padded[:, 0].tolist() == pytest.approx([0.3, -0.6])
    assert sequence_count(mask, seq_id) == 2
    assert per_sequence_mean(torch.tensor([1.0, 3.0, 5.0, 7.0]), mask, seq_id).tolist() == [2.0, 7.0]


def test_cispo_clips_the_weight_not_the_gradient():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ratio = torch.tensor([1.5, 0.5])
    adv = torch.tensor([1.0, -1.0])
    loss, clipped = cispo_token_loss(lp, ratio, adv, eps_low=0.2, eps_high=0.28)
    assert loss.tolist() == pytest.approx([1.28 * 1.0, -(0.8 * -1.0 * -2.0)])
    assert clipped.tolist() == [True, True]
    loss.sum().backward()
    assert lp.grad.tolist() == pytest.approx([-1.28, 0.8])  # both tokens keep a gradient


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 5, 2]
    mask = torch.zeros(3, 6, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, 1:1 + n] = True
    def r(scale):
        return (torch.randn(3, 6, generator=g) * scale)
    lp = (r(0.3) - 1.0)
    return lp, lp + r(0.1), lp + r(0.2), r(1.0), mask


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["cap", "mask", "icepop"])
def test_packed_loss_equals_padded(agg, level, mode):
    """The trainer packs [N]; the same loss on [B, T] rows must give the same value and grads."""
    cfg = PPOLossConfig(loss_agg=agg, ratio_level=level, behav_imp_weight_cap=1.1,
                        behav_imp_weight_mode=mode)
    lp, prox, behav, adv, mask = _batch()
    padded_lp = lp.clone().requires_grad_(True)
    loss_p, _ = ppo_actor_loss(padded_lp, prox, behav, adv, mask, 2.0, cfg)
    loss_p.backward()
    flat = mask.flatten()
    seq_id = torch.arange(3).repeat_interleave(6)[flat]
    packed_lp = lp.flatten()[flat].clone().requires_grad_(True)
    loss_k, _ = ppo_actor_loss(packed_lp, prox.flatten()[flat], behav.flatten()[flat],
                                adv.flatten()[flat], torch.ones_like(seq_id, dtype=torch.bool),
                                2.0, cfg, seq_id=seq_id)
    loss_k.backward()
    assert float(loss_k.detach()) == pytest.approx(float(loss_p.detach()), rel=1e-6)
    torch.testing.assert_close(packed_lp.grad, padded_lp.grad.flatten()[flat])


def test_seq_mean_token_sum_is_not_token_mean():
    """It used to behave as token_mean: the normaliser is now the sequence count."""
    lp, prox, behav, adv, mask = _batch()
    by_tok = aggregate(lp, mask, mask.sum(), "token_mean")
    by_seq = aggregate(lp, mask, sequence_count(mask, None), "seq_mean_token_sum")
    assert float(by_seq) == pytest.approx(float(by_tok) * 10 / 3)  # 10 tokens, 3 sequences


# ---- the train engine ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(TINY, tmp_path_factory.mktemp("opts") / "m")


def _samples(n=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 60, (2 + i % 3,), generator=g).tolist()
        comp = torch.randint(3, 60, (1 + (i * 5) % 7,), generator=g).tolist()
        out.append(Sample.from_prompt_and_completion(prompt, comp, [-1.0] * len(comp),
                                                     [0] * len(comp), reward=float(i % 2)))
    return out


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "seq_mean_token_sum"])
def test_sequence_normaliser_makes_micro_batches_equal_one_batch(model_path, agg):
    def run(budget):
        torch.manual_seed(0)
        eng = HFTrainEngine.from_pretrained(model_path, TrainEngineConfig(
            max_tokens_per_mb=budget, optimizer=OptimizerConfig(lr=1e-2, warmup_steps=0)))
        actor = PPOActor(eng, PPOActorConfig.from_dict({"ppo": {"loss_agg": agg},
                                                        "proximal": {"proximal_logprobs":
                                                                     "behaviour"}}))
        stats = actor.train_step([__import__("asyncrl").Trajectory(_samples()[:3]),
                                  __import__("asyncrl").Trajectory(_samples()[3:])])
        # the step's accumulated gradient (zeroed only when the next step starts)
        return stats, torch.cat([p.grad.flatten() for p in eng.model.parameters()])

    small, grads_small = run(8)
    big, grads_big = run(4096)
    assert small["train/micro_batches"] > 1 and big["train/micro_batches"] == 1
    assert small["train/loss"] == pytest.approx(big["train/loss"], rel=1e-5)
    torch.testing.assert_close(grads_small, grads_big, atol=1e-7, rtol=1e-4)


def test_entropy_reaches_the_loss_and_matches_the_logits(model_path):
    eng = HFTrainEngine.from_pretrained(model_path, TrainEngineConfig(
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0)))
    sample = _samples(1)[0]
    with torch.no_grad():
        logits = eng.model(input_ids=torch.tensor([sample.input_ids])).logits[0]
    want = entropy_from_logits(logits[:-1])  # the distribution each token t >= 1 came from
    seen = {}

    def loss_fn(logprobs, mb, normalizer):
        seen["entropy"] = mb.tensors["entropy"].detach()
        return -(mb.tensors["entropy"] * mb.loss_mask).sum() / normalizer, {}

    eng.train_batch([sample], loss_fn, with_entropy=True)
    torch.testing.assert_close(seen["entropy"][1:], want, atol=1e-5, rtol=0)
    lp, prox, behav, adv, mask = _batch()
    ent = torch.rand(3, 6)
    cfg = PPOLossConfig(entropy_coef=0.5)
    with_bonus, stats = ppo_actor_loss(lp, prox, behav, adv, mask, 10.0, cfg, entropy=ent)
    without, _ = ppo_actor_loss(lp, prox, behav, adv, mask, 10.0, PPOLossConfig(), entropy=ent)
    assert float(without - with_bonus) == pytest.approx(0.5 * float((ent * mask).sum()) / 10.0)
    assert stats["actor/entropy"] == pytest.approx(float(ent[mask].mean()))


def test_bad_combinations_are_refused_when_the_config_loads():
    with pytest.raises(ValueError, match="icepop"):
        PPOLossConfig(behav_imp_weight_mode="icepop")
    with pytest.raises(ValueError, match="behav_imp_weight_floor"):
        PPOLossConfig(behav_imp_weight_floor=0.5)  # a lower bound needs the upper one
    assert PPOLossConfig(behav_imp_weight_cap=2.0, behav_imp_weight_floor=0.5).weight_level == \
        "token"
    assert PPOLossConfig(ratio_level="sequence_token").weight_level == "sequence"
    with pytest.raises(ValueError, match="loss_agg_horizon"):
        PPOLossConfig(loss_agg="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="loss_agg_horizon"):
        PPOLossConfig(loss_agg_horizon=8)
    with pytest.raises(ValueError, match="dppo_tv"):
        PPOLossConfig(policy_objective="dppo_tv", ratio_level="sequence")
    with pytest.raises(ValueError, match="cispo"):
        PPOLossConfig(policy_objective="cispo", ratio_level="sequence")
    with pytest.raises(ValueError, match="behav_imp_weight=false.*behav_imp_weight_cap"):
        PPOLossConfig(behav_imp_weight=False, behav_imp_weight_cap=2.0)
    from asyncrl.config import ConfigError
    from asyncrl.launch.train_config import TrainRunConfig

    with pytest.raises(ConfigError, match="critic.trainable"):
        TrainRunConfig.from_dict({"critic": {"trainable": False}})


# ---- through the trainer ------------------------------------------------------------------

OPTIONS = {
    "no_behaviour_weight": {"actor.proximal.proximal_logprobs": "recompute",
                            "actor.ppo.behav_imp_weight": False},
    "gspo": {"actor.ppo.ratio_level": "sequence", "actor.ppo.loss_agg": "seq_mean_token_mean"},
    "seq_mean_token_sum": {"actor.ppo.loss_agg": "seq_mean_token_sum"},
    "entropy": {"actor.ppo.entropy_coef": 0.01},
    "tis_token": {"actor.proximal.proximal_logprobs": "recompute",
                  "actor.ppo.behav_imp_weight_cap": 2.0},
    "mis_sequence": {"actor.proximal.proximal_logprobs": "recompute",
                     "actor.ppo.behav_imp_weight_cap": 2.0, "actor.ppo.behav_imp_weight_mode": "mask",
                     "actor.ppo.behav_imp_weight_level": "sequence"},
    "icepop": {"actor.proximal.proximal_logprobs": "recompute",
               "actor.ppo.behav_imp_weight_cap": 1.5, "actor.ppo.behav_imp_weight_mode": "icepop"},
    "cispo": {"actor.ppo.policy_objective": "cispo", "actor.ppo.eps_clip_higher": 0.28},
    "gae_critic": {"actor.advantage.estimator": "gae", "actor.advantage.lam": 0.95},
    "rloo": {"actor.advantage.estimator": "rloo"},
    "drgrpo_seq_sum": {"actor.advantage.estimator": "drgrpo",
                       "actor.ppo.loss_agg": "seq_mean_token_sum"},
    "reinforce_pp": {"actor.advantage.estimator": "reinforce_pp"},
    "reinforce_pp_baseline": {"actor.advantage.estimator": "reinforce_pp_baseline"},
    "gspo_token": {"actor.ppo.ratio_level": "sequence_token"},
    "icepop_renormalize": {"actor.proximal.proximal_logprobs": "recompute",
                           "actor.ppo.behav_imp_weight_cap": 1.5,
                           "actor.ppo.behav_imp_weight_mode": "icepop",
                           "actor.ppo.behav_imp_weight_renormalize": True},
    "dppo_tv": {"actor.ppo.policy_objective": "dppo_tv", "actor.ppo.c_clip": 20.0},
    "dppo_kl": {"actor.ppo.policy_objective": "dppo_kl", "actor.ppo.eps_clip": 0.05},
    "drgrpo_constant_norm": {"actor.advantage.estimator": "drgrpo",
                             "actor.ppo.loss_agg": "seq_mean_token_sum_norm",
                             "actor.ppo.loss_agg_horizon": 6},
    "tis_product_two_sided": {"actor.proximal.proximal_logprobs": "recompute",
                              "actor.ppo.behav_imp_weight_cap": 2.0,
                              "actor.ppo.behav_imp_weight_floor": 0.5,
                              "actor.ppo.behav_imp_weight_level": "sequence_product"},
    "grpo_whiten_raw_singletons": {"actor.advantage.whiten": True,
                                   "actor.advantage.singleton_group": "raw",
                                   "actor.advantage.std_eps": 1e-4},
    "grpo_raw_singletons_n1": {"actor.advantage.singleton_group": "raw",
                               "gconfig.n_samples": 1},
    "gae_whiten": {"actor.advantage.estimator": "gae", "actor.advantage.whiten": True},
    "dual_clip_clip_higher": {"actor.ppo.c_clip": 3.0, "actor.ppo.eps_clip_higher": 0.28},
    "overlong_truncated": {"actor.advantage.overlong_buffer_len": 2,
                           "actor.advantage.overlong_max_len": 6,
                           "actor.advantage.truncated": "mask_loss"},
    "zero_reward_minibatches": {"actor.advantage.truncated": "zero_reward",
                                "actor.ppo_n_minibatches": 2},
    "kl_loss_k1_loglinear": {"actor.ppo.kl_coef": 0.05, "actor.ppo.kl_kind": "k1",
                             "actor.proximal.proximal_logprobs": "loglinear"},
    "gae_truncated_bootstrap": {"actor.advantage.estimator": "gae",
                                "actor.advantage.truncated_bootstrap": True,
                                "gconfig.max_new_tokens": 2},
    "gae_kl_reward": {"actor.advantage.estimator": "gae", "actor.ppo.kl_coef": 0.05,
                      "actor.ppo.kl_as": "reward"},
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_trains_through_the_trainer(model_dir, tmp_path, name):
    cfg = small_config(model_dir, tmp_path / name, **{"total_steps": 2, "eval.every": 0,
                                                       **OPTIONS[name]})
    result = Trainer(cfg).train(reward=digit_reward)
    assert result.steps == 2
    import json
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "reward/mean" in m]
    assert len(steps) == 2 and all(math.isfinite(m["train/loss"]) for m in steps)
    if name == "entropy":
        assert all(m["actor/entropy"] > 0 for m in steps)
    if name.startswith("gae"):
        assert all(math.isfinite(m["critic/loss"]) for m in steps)
    if name == "gae_truncated_bootstrap":  # 2 new tokens: rows are cut, and bootstrapped
        assert all(m["adv/truncated_frac"] > 0 for m in steps)
    if name == "gae_kl_reward":
        assert "actor/kl_reward_mean" in steps[-1] and "actor/kl_ref" not in steps[-1]


def test_critic_is_checkpointed_and_resumed(model_dir, tmp_path, monkeypatch):
    run = tmp_path / "run"
    over = {"actor.advantage.estimator": "gae", "eval.every": 0, "checkpoint_every": 1}
    Trainer(small_config(model_dir, run, total_steps=2, **over)).train(reward=digit_reward)
    saved = critic_weights(model_dir, run / "checkpoints/step_000002")
    assert "value_head.weight" in saved
    restored = {}
    load = HFTrainEngine.load_state_dict

    def recording_load(engine, state):  # what each engine holds right after its restore
        load(engine, state)
        if isinstance(engine.model, ValueModel):
            restored.update({k: v.detach().clone() for k, v in engine.model.state_dict().items()})

    monkeypatch.setattr(HFTrainEngine, "load_state_dict", recording_load)
    resumed = Trainer(small_config(model_dir, run, total_steps=3, **over), run_dir=run)
    assert resumed.train(reward=digit_reward, resume=True).steps == 3
    assert set(restored) == set(saved)
    for name, tensor in saved.items():  # the resumed critic started from the saved one
        torch.testing.assert_close(restored[name], tensor)
    after = critic_weights(model_dir, run / "checkpoints/step_000003")
    assert float((after["value_head.weight"] - saved["value_head.weight"]).abs().max()) > 0


def critic_weights(model_dir, ckpt) -> dict[str, torch.Tensor]:
    """The critic's weights in a run checkpoint, read into a fresh critic engine."""
    critic = load_critic(model_dir, CriticConfig(), "float32", 10, SingleProcess())
    load_state(ckpt / "state", critic.parallel, {"critic": critic})
    return {k: v.detach().clone() for k, v in critic.model.state_dict().items()}


# ---- the mismatch monitor ----------------------------------------------------------------

def test_mismatch_monitor_by_hand():
    from asyncrl.api import LossInputs
    from asyncrl.train.mismatch import MismatchMonitor

    behav = torch.tensor([-1.0, -2.0, -3.0, -0.5])
    inputs = LossInputs(
        loss_mask=torch.tensor([True, True, True, False]), behaviour_logprobs=behav,
        proximal_logprobs=behav + torch.tensor([0.0, math.log(3.0), 0.0, 5.0]),
        advantages=torch.zeros(4), versions=torch.tensor([4, 4, 3, 4]),
        seq_id=torch.zeros(4, dtype=torch.long), policy_version=4)
    mon = MismatchMonitor()
    mon.add(behav + torch.tensor([0.1, -0.3, 2.0, 9.0]), inputs)
    got = mon.summary()
    # fresh trained tokens: the first two (the third is stale, the fourth not trained)
    assert got["mismatch/fresh_tokens"] == 2
    assert got["mismatch/logprob_diff_mean"] == pytest.approx(0.2)
    assert got["mismatch/logprob_diff_max"] == pytest.approx(0.3)
    # w = pi_theta / pi_behav over the trained tokens, whatever the proximal policy is
    assert got["mismatch/iw_max"] == pytest.approx(math.exp(2.0))
    assert got["mismatch/iw_min"] == pytest.approx(math.exp(-0.3))
    assert got["mismatch/iw_over_2_frac"] == pytest.approx(1 / 3)
    assert mon.summary() == {"mismatch/fresh_tokens": 0.0}  # emptied


def test_every_run_logs_the_mismatch_and_plots_it(model_dir, tmp_path):
    import json

    cfg = small_config(model_dir, tmp_path / "run", **{"eval.every": 0,
                                                       "rollout.max_head_offpolicyness": 0})
    Trainer(cfg).train(reward=digit_reward)
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "reward/mean" in m]
    # eta = 0: every token is fresh; the in-process engine (fp32, its own kernels) and the HF
    # trainer agree to float rounding
    assert all(m["mismatch/fresh_tokens"] > 0 for m in steps)
    assert all(m["mismatch/logprob_diff_max"] < 1e-3 for m in steps)
    assert all(m["staleness/hist_0"] == 1.0 for m in steps)
    assert (tmp_path / "run/plot.png").stat().st_size > 0
