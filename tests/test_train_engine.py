"""Packing and the single-process train engine on a tiny CPU model."""

from __future__ import annotations

import random

import pytest
from conftest import make_samples
import torch

from asyncrl.api.protocols import TrainEngine
from asyncrl.api.trajectory import Sample
from asyncrl.config import ConfigError
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.train.engine import HFTrainEngine, sft_token_loss
from asyncrl.train.heads import LogprobHead
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.logprobs import gather_logprobs
from asyncrl.train.config import OptimizerConfig
from asyncrl.train.packing import (
    balanced_partition,
    first_fit_decreasing,
    pack_samples,
    padded_layout,
    plan_micro_batches,
    prefix_units,
    shared_prefix_layout,
    shared_prefix_len,
    unpack,
)

TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_size=128)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TINY, tmp_path_factory.mktemp("tiny"))


def reference_logprobs(model, s: Sample) -> torch.Tensor:
    """Unpadded single-sequence logprobs, input-aligned (0 for the first token)."""
    ids = torch.tensor([s.input_ids])
    logits = model(input_ids=ids, use_cache=False).logits[0]
    lp = gather_logprobs(logits[:-1], ids[0, 1:])
    return torch.cat([torch.zeros(1), lp])


def padded_logprobs(model, samples) -> list[torch.Tensor]:
    """Right-padded batch with an attention mask: the layout packing replaces."""
    width = max(len(s.input_ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, :len(s.input_ids)] = torch.tensor(s.input_ids)
        attn[i, :len(s.input_ids)] = 1
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    lp = gather_logprobs(logits[:, :-1], ids[:, 1:])
    lp = torch.cat([torch.zeros(len(samples), 1), lp], dim=1)
    return [lp[i, :len(s.input_ids)] for i, s in enumerate(samples)]


# --- packing -----------------------------------------------------------------------------

def test_first_fit_decreasing_respects_budget_and_keeps_long_items_alone():
    lengths = [5, 9, 3, 7, 2, 20]
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= 10
    assert [5] in bins  # 20 > budget: its own bin, never split
    with pytest.raises(ValueError, match="max_tokens_per_mb=0"):
        first_fit_decreasing(lengths, 0)


def test_balanced_partition_and_plan():
    lengths = [8, 7, 6, 5, 4, 3, 2, 1]
    parts = balanced_partition(lengths, 2)
    assert [sum(lengths[i] for i in p) for p in parts] == [18, 18]
    assert balanced_partition([3], 3)[1:] == [[], []]
    samples = make_samples(lengths)
    groups = plan_micro_batches(samples, range(len(samples)), 12, agree=lambda n: max(n, 4))
    assert len(groups) == 4 and all(sum(lengths[i] for i in g) <= 12 for g in groups)
    # least-loaded placement would put 9 + 2 together, over 10; FFD's bins always fit
    tight = make_samples([7, 2, 9, 6, 3, 2])
    assert sorted(plan_micro_batches(tight, range(6), 10)) == [[0, 4], [1, 3, 5], [2]]


def test_pack_samples_layout_and_unpack_roundtrip():
    samples = make_samples([4, 3, 5])
    adv = [torch.tensor([float(10 * i + t) for t in range(len(s.input_ids))])
           for i, s in enumerate(samples)]
    mb = pack_samples(samples, [2, 0], {"advantages": adv})
    assert mb.input_ids[0].tolist() == samples[2].input_ids + samples[0].input_ids
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert mb.cu_seqlens.tolist() == [0, 5, 9]
    assert mb.tensors["seq_id"].tolist() == [0] * 5 + [1] * 4
    assert not mb.tensors["loss_mask"][[0, 5]].any()  # sample starts never carry loss
    back = unpack(mb.tensors["advantages"], mb)
    assert back[0].tolist() == adv[2].tolist() and back[1].tolist() == adv[0].tolist()
    assert mb.loss_mask is mb.tensors["loss_mask"] and mb.seq_id is mb.tensors["seq_id"]
    with pytest.raises(ValueError, match="token_data"):
        pack_samples(samples, [0], {"advantages": [torch.zeros(1)] * 3})


def test_micro_batches_cover_every_sample_once():
    samples = make_samples([9, 4, 7, 3, 8, 2, 6])
    mbs = [pack_samples(samples, g)
           for g in plan_micro_batches(samples, range(len(samples)), 12)]
    seen = sorted(i for mb in mbs for i in mb.sample_index)
    assert seen == list(range(len(samples)))
    assert all(mb.num_tokens <= 12 for mb in mbs)


def pack_all(samples):
    return pack_samples(samples, range(len(samples)))


# --- engine ------------------------------------------------------------------------------

def engine(model_dir, temperature=1.0, trainable=True, **kw) -> HFTrainEngine:
    """On the CPU in fp32 (also on a CUDA machine): the references here are CPU forwards."""
    opt = kw.pop("optimizer", OptimizerConfig(lr=1e-2, grad_clip=1.0))
    kw.setdefault("device", "cpu")
    return HFTrainEngine(load_causal_lm(model_dir), TrainEngineConfig(optimizer=opt, **kw),
                         head=LogprobHead(temperature), trainable=trainable)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_packed_forward_equals_unpadded_and_padded(model_dir, layout):
    eng = engine(model_dir, max_tokens_per_mb=64, attention_layout=layout)
    assert eng.padded == (layout == "padded")
    samples = make_samples([7, 12, 3, 9, 1])
    packed = eng.forward(samples)
    assert isinstance(eng, TrainEngine)
    with torch.no_grad():
        padded = padded_logprobs(eng.model, samples)
        for s, got, pad in zip(samples, packed, padded):
            want = reference_logprobs(eng.model, s)
            assert got.shape == (len(s.input_ids),) and got[0] == 0.0
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            torch.testing.assert_close(pad, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_packed_grads_equal_per_sequence_grads(model_dir, layout):
    eng = engine(model_dir, max_tokens_per_mb=64, attention_layout=layout)
    samples = make_samples([6, 10, 4], seed=1)
    mb = pack_all(samples)
    assert len(mb.sample_index) == 3
    mask = mb.tensors["loss_mask"]
    eng.per_token(mb)[mask].sum().backward()
    packed = {n: p.grad.clone() for n, p in eng.model.named_parameters()}
    eng.model.zero_grad()
    for s in samples:
        m = torch.tensor(s.loss_mask, dtype=torch.bool)
        m[0] = False
        reference_logprobs(eng.model, s)[m].sum().backward()
    for n, p in eng.model.named_parameters():
        torch.testing.assert_close(packed[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_temperature_enters_logprobs(model_dir):
    eng = engine(model_dir, temperature=2.0)
    s = make_samples([6])[0]
    got = eng.forward([s])[0]
    with torch.no_grad():
        ids = torch.tensor([s.input_ids])
        logits = eng.model(input_ids=ids).logits[0]
        want = gather_logprobs(logits[:-1], ids[0, 1:], temperature=2.0)
    torch.testing.assert_close(got[1:], want, atol=1e-5, rtol=0)


# Adam divides by |g| + eps, so a gradient of ~1e-9 whose last bits differ (summation order)
# moves its weight by ~lr either way; comparisons of weights after a step use an eps that keeps
# such near-zero gradients in the linear regime.
EXACT_OPT = OptimizerConfig(lr=1e-3, eps=1e-6, grad_clip=1.0)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_micro_batch_accumulation_equals_one_batch(model_dir, layout):
    samples = make_samples([9, 4, 7, 3, 8, 5], seed=2)
    one = engine(model_dir, max_tokens_per_mb=1000, optimizer=EXACT_OPT)
    many = engine(model_dir, max_tokens_per_mb=14, optimizer=EXACT_OPT, attention_layout=layout)
    s1 = one.train_batch(samples, sft_token_loss)
    s3 = many.train_batch(samples, sft_token_loss)
    assert s1["train/micro_batches"] == 1 and s3["train/micro_batches"] == 3
    assert s1["train/loss_tokens"] == s3["train/loss_tokens"]
    assert abs(s1["train/loss"] - s3["train/loss"]) < 1e-6
    assert abs(s1["train/grad_norm"] - s3["train/grad_norm"]) < 1e-6
    assert abs(s1["sft/nll_per_token"] - s3["sft/nll_per_token"]) < 1e-5
    for (n, a), b in zip(one.model.named_parameters(), many.model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=0, msg=n)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=n)


def test_train_steps_decrease_sft_loss(model_dir):
    eng = engine(model_dir, max_tokens_per_mb=20)
    samples = make_samples([8, 10, 6, 12], seed=3)
    losses = [eng.train_batch(samples, sft_token_loss)["train/loss"] for _ in range(6)]
    assert losses[-1] < 0.8 * losses[0], losses


def test_bf16_autocast_and_checkpointing_run(model_dir):
    eng = engine(model_dir, autocast_dtype="bfloat16", gradient_checkpointing=True,
                 max_tokens_per_mb=16)
    samples = make_samples([8, 10], seed=4)
    stats = eng.train_batch(samples, sft_token_loss)
    assert torch.isfinite(torch.tensor(stats["train/loss"]))
    assert next(eng.model.parameters()).dtype == torch.float32  # master weights stay fp32


def test_version_bookkeeping(model_dir):
    """An optimizer step is not a policy update: the engine owns the version, the PPO actor
    advances it once per batch (test_ppo_actor), a resume sets it."""
    eng = engine(model_dir)
    seen = []
    eng.version.subscribe(seen.append)
    assert eng.version.value == 0
    eng.train_batch(make_samples([5]), sft_token_loss)
    assert eng.version.value == 0 and eng.step == 1
    eng.version.set(7)
    assert eng.version.advance() == 8 and seen == [7, 8]
    with pytest.raises(ValueError, match="version=-1"):
        eng.version.set(-1)


def test_forward_only_reference_engine(model_dir):
    ref = engine(model_dir, trainable=False)
    assert ref.optimizer is None
    assert not any(p.requires_grad for p in ref.model.parameters())
    lp = ref.forward(make_samples([5, 3]))
    assert [t.shape[0] for t in lp] == [5, 3]
    with pytest.raises(ValueError, match="forward-only"):
        ref.train_batch(make_samples([5]), sft_token_loss)


def grouped_samples(prompts=((5, 9, 14, 3), (7, 21)), per_group=3, seed=4) -> list[Sample]:
    """GRPO-style groups: `per_group` completions of different lengths after each prompt."""
    rng = random.Random(seed)
    out = []
    for prompt in prompts:
        for j in range(per_group):
            n = 2 + j + rng.randrange(3)
            out.append(Sample.from_prompt_and_completion(
                list(prompt), [rng.randrange(3, 60) for _ in range(n)], [-1.0] * n, [0] * n))
    return out


def test_shared_prefix_logprobs_equal_whole_sequences(model_dir):
    eng = engine(model_dir, attention_layout="padded")
    samples = grouped_samples()
    mb = pack_all(samples)
    lay = shared_prefix_layout(mb)
    assert lay is not None and lay.prefix_ids.shape == (2, 3)  # each prompt but its last token
    got = eng.forward(samples)
    with torch.no_grad():
        for s, lp in zip(samples, got):
            start = shared_prefix_len(s.loss_mask) + 1  # the first position it computes
            want = reference_logprobs(eng.model, s)
            torch.testing.assert_close(lp[start:], want[start:], atol=1e-5, rtol=0)
            assert not lp[:start].any()  # inside the shared prompt: not computed, 0


def test_shared_prefix_grads_equal_per_sequence_grads(model_dir):
    eng = engine(model_dir, attention_layout="padded")
    samples = grouped_samples(seed=5)
    mb = pack_all(samples)
    eng.per_token(mb)[mb.tensors["loss_mask"]].sum().backward()
    shared = {n: p.grad.clone() for n, p in eng.model.named_parameters()}
    eng.model.zero_grad()
    for s in samples:
        m = torch.tensor(s.loss_mask, dtype=torch.bool)
        reference_logprobs(eng.model, s)[m].sum().backward()
    for n, p in eng.model.named_parameters():
        torch.testing.assert_close(shared[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_plan_keeps_a_prompt_group_in_one_micro_batch(model_dir):
    samples = grouped_samples(prompts=((5, 9, 14, 3), (7, 21), (8, 8, 8)), per_group=4)
    assert prefix_units(samples, range(len(samples))) == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                           [8, 9, 10, 11]]
    eng = engine(model_dir, attention_layout="padded", max_tokens_per_mb=30)
    mbs, _ = eng._plan(samples, None)
    assert len(mbs) > 1
    for mb in mbs:
        assert len({tuple(samples[i].input_ids[:2]) for i in mb.sample_index}) == 1
    off = engine(model_dir, attention_layout="padded", share_prefixes=False)
    mb = off._plan(samples, None)[0][0]
    assert off.model_outputs(mb)[1] is None  # sharing off: every position computed


def test_padded_layout_places_each_token(model_dir):
    mb = pack_all(make_samples([3, 5, 1]))
    ids, mask, index = padded_layout(mb)
    assert ids.shape == mask.shape == (3, 5) and int(mask.sum()) == mb.num_tokens == 9
    assert torch.equal(ids.flatten()[index], mb.input_ids[0])
    assert mask.sum(1).tolist() == [len(make_samples([3, 5, 1])[i].input_ids)
                                    for i in mb.sample_index]


def test_the_packed_layouts_switch_sdpa_to_varlen_and_keep_a_flash_kernel(model_dir):
    """auto (choosing per micro-batch: test_packed_trainer.py) and packed switch SDPA to the
    varlen attention; padded keeps SDPA; a flash kernel is kept."""
    assert engine(model_dir, attention_layout="padded").model.config._attn_implementation == "sdpa"
    assert engine(model_dir).model.config._attn_implementation == "asyncrl_varlen"
    packed = engine(model_dir, attention_layout="packed")
    assert packed.model.config._attn_implementation == "asyncrl_varlen"
    model = load_causal_lm(model_dir)
    model.config._attn_implementation = "flash_attention_2"
    assert not HFTrainEngine(model, TrainEngineConfig(attention_layout="packed")).padded
    assert model.config._attn_implementation == "flash_attention_2"  # kept


def test_config_rejects_bad_budget():
    with pytest.raises(ConfigError, match="max_tokens_per_mb"):
        TrainEngineConfig.from_dict({"max_tokens_per_mb": 0})
    with pytest.raises(ConfigError, match="did you mean"):
        TrainEngineConfig.from_dict({"max_token_per_mb": 8})


def test_token_data_reaches_loss_fn(model_dir):
    eng = engine(model_dir, max_tokens_per_mb=8)
    samples = make_samples([5, 6], seed=5)
    adv = [torch.full((len(s.input_ids),), 2.0) for s in samples]
    seen = []

    def loss_fn(logprobs, mb, normalizer):
        seen.append(float(mb.tensors["advantages"][mb.loss_mask].mean()))
        loss = -(logprobs * mb.tensors["advantages"] * mb.loss_mask).sum() / normalizer
        return loss, {}

    eng.train_batch(samples, loss_fn, token_data={"advantages": adv})
    assert seen == [2.0, 2.0]
