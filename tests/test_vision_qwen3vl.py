"""The newest Qwen VLM family, Qwen3-VL, served natively: its decoder is Qwen3's (q/k norms) with
interleaved M-RoPE, and its vision tower's DeepStack features join the first decoder layers'
hidden states at the image tokens. The tiny random Qwen3-VL (`build-model --preset tiny-qwen3-vl`,
the embedded tokenizer and image processor; no hub is reachable): its prompt encodes through VisionPromptEncoder, the
in-process engine (the compact model with its vision tower, and the transformers fallback)
samples with the image, and the trainer's per-token logprobs equal the sampler's (fp32, 1e-4),
before and after a weight update."""

from __future__ import annotations

import pytest
import torch

from asyncrl.api import GenerationConfig, ModelRequest, Sample
from asyncrl.data.counting import CountingTaskConfig
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.inference.model_runner import ModelRunner
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.vision import VisionPromptEncoder, row_prompt
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.engine import HFTrainEngine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen3vl_dir(tmp_path_factory):
    from asyncrl.models.presets import build_preset_model

    return build_preset_model("tiny-qwen3-vl", tmp_path_factory.mktemp("qwen3-vl"))


def sample(engine, prompts, seed=5):
    g = GenerationConfig(max_new_tokens=6, min_new_tokens=6, temperature=1.0, top_k=0, seed=seed)
    outs = engine.generate([ModelRequest(ids, g, rid=f"r{i}", images=images)
                            for i, (ids, images) in enumerate(prompts)])
    samples = []
    for (ids, images), out in zip(prompts, outs):
        assert len(out.output_tokens) == 6
        s = Sample.from_prompt_and_completion(ids, out.output_tokens, out.output_logprobs,
                                              out.output_versions)
        s.images = images
        samples.append(s)
    return samples


def check(model, samples):
    trainer = HFTrainEngine(model, TrainEngineConfig(device="cpu"), trainable=False)
    for s, lp in zip(samples, trainer.forward(samples)):
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(lp[mask], torch.tensor(s.logprobs)[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_qwen3_vl_samples_and_trains_with_equal_logprobs(qwen3vl_dir, backend):
    encoder = VisionPromptEncoder.from_model_dir(qwen3vl_dir)
    rows = CountingTaskConfig(num_train=0, num_eval=3).build().eval_rows()
    prompts = [row_prompt(encoder.tokenizer, encoder, r) for r in rows]
    engine = LLMEngine(EngineConfig(model_path=str(qwen3vl_dir), backend=backend))
    assert isinstance(engine.runner, ModelRunner) == (backend == "native")
    model = load_causal_lm(qwen3vl_dir)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    check(model, sample(engine, prompts))
    # a weight update (both towers and the decoder): the engine follows it exactly
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    engine.update_weights_from_state_dict(new, version=1)
    model.load_state_dict(new)
    check(model, sample(engine, prompts, seed=9))


def test_a_qwen3_vl_trains_on_images(qwen3vl_dir, tmp_path):
    """`asyncrl train` on the counting task with the Qwen3-VL: rollouts with images on the
    in-process engine, 3 steps, the logprob canary after every push within 1e-3."""
    from test_train_loop import metrics, small_config

    from asyncrl import Trainer

    run = tmp_path / "run"
    cfg = small_config(qwen3vl_dir, run, **{
        "data": {"kind": "counting", "num_train": 64, "num_eval": 8, "max_objects": 4},
        "gconfig.max_new_tokens": 3, "inference.check_logprobs_every": 1})
    assert Trainer(cfg).train().steps == 3
    checked = [m["weight_check/max_abs_diff"] for m in metrics(run)
               if "weight_check/max_abs_diff" in m]
    assert len(checked) == 3 and max(checked) < 1e-3
