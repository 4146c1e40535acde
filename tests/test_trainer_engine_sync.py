"""Trainer -> inference engine: after a weight push, the engine samples with exactly the policy
the trainer computes (behaviour logprobs == trainer logprobs within 1e-4, new version on every
token). This is what makes the importance ratio of on-policy data exactly 1."""

import asyncio

import torch

from asyncrl.api import GenerationConfig, ModelRequest, Sample, WeightUpdateMeta
from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.train.engine import HFTrainEngine, sft_token_loss
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.config import OptimizerConfig


def test_weight_push_makes_engine_logprobs_equal_trainer_logprobs(tmp_path):
    torch.manual_seed(0)
    model_dir = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2,
                                                 num_kv_heads=1, intermediate_size=128, seed=5),
                                 tmp_path / "m")
    trainer = HFTrainEngine.from_pretrained(
        model_dir, TrainEngineConfig(device="cpu", optimizer=OptimizerConfig(lr=5e-2)),
        total_steps=10)  # both on the CPU in fp32, also on a CUDA machine: exact equality
    engine = AsyncLLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=96, device="cpu"))
    prompts = [[5 + i, 20 + i, 40, 41, 42][: 3 + i % 3] for i in range(6)]
    gconfig = GenerationConfig(max_new_tokens=12, min_new_tokens=12, temperature=1.0, seed=7)

    async def rollout():
        return await asyncio.gather(*(engine.agenerate(ModelRequest(p, gconfig)) for p in prompts))

    try:
        before = asyncio.run(rollout())
        samples = [Sample.from_prompt_and_completion(r.input_tokens, r.output_tokens,
                                                     r.output_logprobs, r.output_versions)
                   for r in before]
        for _ in range(2):  # move the trainer's weights well away from the engine's
            trainer.train_batch(samples, sft_token_loss)
        trainer.version.advance()
        asyncio.run(engine.update_weights(WeightUpdateMeta.from_tensors(1),
                                          trainer.model.state_dict()))
        after = asyncio.run(rollout())
    finally:
        engine.shutdown()
    fresh = [Sample.from_prompt_and_completion(r.input_tokens, r.output_tokens,
                                               r.output_logprobs, r.output_versions)
             for r in after]
    trainer_lp = trainer.forward(fresh)
    worst = 0.0
    for s, lp in zip(fresh, trainer_lp):
        gen = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert set(v for v, m in zip(s.versions, s.loss_mask) if m) == {1}
        worst = max(worst, (lp[gen] - torch.tensor(s.logprobs)[gen]).abs().max().item())
    assert worst < 1e-4, worst
    # and the push really changed the policy: the old behaviour logprobs no longer match
    stale = trainer.forward(samples)
    drift = max((lp[torch.tensor(s.loss_mask, dtype=torch.bool)]
                 - torch.tensor(s.logprobs)[torch.tensor(s.loss_mask, dtype=torch.bool)]).abs().max().item()
                for s, lp in zip(samples, stale))
    assert drift > 1e-2, drift
