"""The value-head critic: shapes, packed == unpacked, and regression toward fixed returns."""

from __future__ import annotations


import pytest
from conftest import make_samples
import torch

from asyncrl.api.trajectory import Sample
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.train.critic import ValueModel, critic_token_loss, values_and_end_values
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.heads import ValueHead
from asyncrl.train.config import CriticConfig
from asyncrl.train.config import OptimizerConfig

TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_size=128)
LENGTHS = [5, 17, 9, 30, 2, 12]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TINY, tmp_path_factory.mktemp("tiny"))


def critic(model_dir, trainable=True, **cfg) -> HFTrainEngine:
    torch.manual_seed(0)  # the value head's init
    return HFTrainEngine(ValueModel(load_causal_lm(model_dir)), CriticConfig(device="cpu", **cfg),
                         head=ValueHead(), trainable=trainable)


def test_values_have_one_entry_per_token_and_zero_at_start(model_dir):
    samples = make_samples(LENGTHS)
    values = critic(model_dir, trainable=False).forward(samples)
    assert [v.shape for v in values] == [torch.Size([n]) for n in LENGTHS]
    assert all(v.dtype == torch.float32 for v in values)
    assert all(v[0] == 0 for v in values)
    assert all(v[1:].abs().sum() > 0 for v in values if len(v) > 1)  # a real head, not zeros


def test_packed_values_equal_unpacked(model_dir):
    """One row per sample, no packing, head on h_{t-1}: the packed engine must match it."""
    samples = make_samples(LENGTHS, seed=1)
    engine = critic(model_dir, trainable=False, max_tokens_per_mb=40)  # several multi-sample mbs
    packed = engine.forward(samples)
    with torch.no_grad():
        for s, got in zip(samples, packed):
            v = engine.model(input_ids=torch.tensor([s.input_ids]))[0]
            want = torch.cat([torch.zeros(1), v[:-1]])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_end_values_are_the_head_on_each_samples_last_token(model_dir):
    """What GAE bootstraps a truncated row from: V(state after the last token), the head on the
    last token's hidden state; the values before it are the plain forward's."""
    samples = make_samples(LENGTHS, seed=2)
    engine = critic(model_dir, trainable=False, max_tokens_per_mb=40)
    values, ends = values_and_end_values(engine, samples)
    assert ends.shape == (len(samples),)
    for got, want in zip(values, engine.forward(samples)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with torch.no_grad():
        for s, end in zip(samples, ends):
            v = engine.model(input_ids=torch.tensor([s.input_ids]))[0]
            torch.testing.assert_close(end, v[-1].float(), atol=1e-5, rtol=0)


def test_shared_prompt_values_equal_unshared(model_dir):
    """A GRPO group's prompt is computed once: the values it feeds are the same."""
    samples = [Sample.from_prompt_and_completion([5, 9, 14, 3], out, [-1.0] * len(out),
                                                 [0] * len(out))
               for out in ([7, 8], [9, 10, 11], [12])]
    shared = critic(model_dir, trainable=False).forward(samples)
    whole = critic(model_dir, trainable=False, share_prefixes=False).forward(samples)
    for got, want in zip(shared, whole):
        torch.testing.assert_close(got[4:], want[4:], atol=1e-5, rtol=0)  # the trained part
        assert not got[1:4].any()  # inside the shared prompt: not computed


def test_critic_regresses_toward_fixed_returns(model_dir):
    samples = make_samples(LENGTHS, seed=2)
    targets = [0.8, -0.5, 0.3, -0.9, 0.6, 0.1]
    returns = [torch.full((len(s.input_ids),), r) for s, r in zip(samples, targets)]
    engine = critic(model_dir, optimizer=OptimizerConfig(lr=3e-3), max_tokens_per_mb=32)
    losses = []
    for _ in range(15):
        old = engine.forward(samples)
        stats = engine.train_batch(samples, critic_token_loss(0.2),
                                   token_data={"returns": returns, "old_values": old})
        losses.append(stats["train/loss"])
    assert stats["train/micro_batches"] > 1  # the budget really split the batch
    assert losses[-1] < 0.3 * losses[0], losses
    assert engine.step == 15


def test_critic_loss_needs_returns(model_dir):
    engine = critic(model_dir)
    with pytest.raises(ValueError, match="returns"):
        engine.train_batch(make_samples([6]), critic_token_loss())


def test_value_model_rejects_a_model_without_a_decoder_body():
    with pytest.raises(ValueError, match="model.layers"):
        ValueModel(torch.nn.Linear(2, 2))
