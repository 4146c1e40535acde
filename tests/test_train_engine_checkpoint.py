"""Checkpoint resume is exact on one process: 4 steps == 2 steps, save, fresh engine, load, 2 steps.

The engine saves through its `state_dict` with `save_state` (train/checkpoint.py), beside a
plain part (here the data position a run would keep).

Resuming on another world size (sharded state saved on 2 ranks, loaded on 1 and 2, and back)
is tested with FSDP in test_train_engine_fsdp.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncrl.api.trajectory import Sample
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.train.checkpoint import METADATA, PLAIN_FILE, load_state, save_state
from asyncrl.train.config import OptimizerConfig, TrainEngineConfig
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.losses import sft_loss

TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_size=128)
# Warmup + cosine: a resume that lost the scheduler state would use the wrong learning rate.
CFG = TrainEngineConfig(max_tokens_per_mb=16, optimizer=OptimizerConfig(
    lr=1e-2, warmup_steps=1, schedule="cosine", min_lr_ratio=0.1, grad_clip=1.0))
STEPS = 4  # the LR schedule's horizon


class Position:
    """A plain stateful part, as a run's data stream."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"position": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["position"]


def new_engine(model_dir, **kw) -> HFTrainEngine:
    return HFTrainEngine(load_causal_lm(model_dir), CFG, total_steps=STEPS, **kw)


@pytest.fixture(autouse=True)
def deterministic():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(threads)


def samples_for(step: int) -> list[Sample]:
    rng = random.Random(step)
    out = []
    for n in (6, 9, 5):
        ids = [rng.randrange(3, 60) for _ in range(n)]
        out.append(Sample.from_prompt_and_completion(ids[:2], ids[2:], [-1.0] * (n - 2),
                                                     [0] * (n - 2)))
    return out


def noisy_loss(logprobs, mb, normalizer):
    """SFT loss with random token weights drawn from torch + numpy + python RNGs, so a resume
    that did not restore the RNG states trains on different weights."""
    noise = torch.rand(logprobs.shape) + float(np.random.rand()) + random.random()
    mask = mb.loss_mask
    return sft_loss(logprobs * noise, mask, normalizer)


def train(engine: HFTrainEngine, steps: range) -> None:
    for step in steps:
        engine.train_batch(samples_for(step), noisy_loss)
        engine.version.advance()  # one policy update per step, as the PPO actor does


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_resume_is_exact(tmp_path):
    model_dir = build_tiny_model(TINY, tmp_path / "tiny")
    seed_all(0)
    straight = new_engine(model_dir)
    train(straight, range(4))

    seed_all(0)
    first = new_engine(model_dir)
    train(first, range(2))
    ckpt = tmp_path / "ckpt"
    save_state(ckpt, first.parallel, {"trainer": first}, {"data": Position(2)})
    save_state(ckpt, first.parallel, {"trainer": first}, {"data": Position(2)})  # overwrite ok

    seed_all(123)  # the resumed run must not depend on the new process's seeds
    resumed = new_engine(model_dir)
    data = Position()
    load_state(ckpt, resumed.parallel, {"trainer": resumed}, {"data": data})
    assert data.value == 2
    assert resumed.step == 2 and resumed.version.value == 2
    assert resumed.scheduler.get_last_lr() == first.scheduler.get_last_lr()
    train(resumed, range(2, 4))

    assert resumed.version.value == straight.version.value == 4
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
    assert {METADATA, PLAIN_FILE} <= {p.name for p in ckpt.iterdir()}


def test_forward_only_engine_loads_the_weights_of_a_trainer_checkpoint(tmp_path):
    model_dir = build_tiny_model(TINY, tmp_path / "tiny")
    trained = new_engine(model_dir)
    train(trained, range(1))
    save_state(tmp_path / "ckpt", trained.parallel, {"trainer": trained})
    ref = new_engine(model_dir, trainable=False)
    load_state(tmp_path / "ckpt", ref.parallel, {"trainer": ref})
    assert ref.optimizer is None and ref.step == 1
    for (name, a), b in zip(trained.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(a, b), name


def test_resume_without_rng_restore_differs(tmp_path):
    """Guards the test above: the noisy loss really depends on the RNG states."""
    model_dir = build_tiny_model(TINY, tmp_path / "tiny")
    seed_all(0)
    a = new_engine(model_dir)
    train(a, range(1))
    seed_all(1)
    b = new_engine(model_dir)
    train(b, range(1))
    diffs = [float((x - y).detach().abs().max()) for x, y in zip(a.model.parameters(), b.model.parameters())]
    assert max(diffs) > 1e-4


def test_load_missing_checkpoint_names_the_file(tmp_path):
    model_dir = build_tiny_model(TINY, tmp_path / "tiny")
    engine = new_engine(model_dir)
    with pytest.raises(FileNotFoundError, match="has no .metadata; expected a directory written"):
        load_state(tmp_path / "nope", engine.parallel, {"trainer": engine})
