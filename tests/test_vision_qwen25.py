"""The same code paths serve a Qwen2.5-VL as the embedded Qwen2-VL: a tiny random Qwen2.5-VL
(window attention in its vision tower, a gated MLP, out_hidden_size) built here with the embedded
tokenizer and image processor, since no hub is reachable. Its prompt encodes through
VisionPromptEncoder, the in-process engine (the compact model with its vision tower, and the
transformers fallback) samples with the image, and the trainer's per-token logprobs equal the
sampler's (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.api import GenerationConfig, ModelRequest, Sample
from asyncrl.data.counting import CountingTaskConfig
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.models.config import TinyModelConfig
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.vision import VisionPromptEncoder, row_prompt
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.engine import HFTrainEngine


@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    from asyncrl.models.export import save_model_dir
    from asyncrl.models.tiny_vl import (
        build_vl_tokenizer,
        save_image_processor,
        tiny_vl_config,
    )

    tokenizer = build_vl_tokenizer()
    base = tiny_vl_config(tokenizer, TinyModelConfig(arch="qwen2_vl", num_layers=2)).to_dict()
    cfg = Qwen2_5_VLConfig(
        text_config=base["text_config"],
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4,
                           out_hidden_size=256, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
        **{k: base[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                "vision_end_token_id", "tie_word_embeddings")},
        architectures=["Qwen2_5_VLForConditionalGeneration"])
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    out = save_model_dir(model, tokenizer, tmp_path_factory.mktemp("qwen25-vl"))
    save_image_processor(out, patch_size=14)
    return out


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_qwen25_vl_samples_and_trains_with_equal_logprobs(qwen25_dir, backend):
    encoder = VisionPromptEncoder.from_model_dir(qwen25_dir)
    rows = CountingTaskConfig(num_train=0, num_eval=2).build().eval_rows()
    prompts = [row_prompt(encoder.tokenizer, encoder, r) for r in rows]
    engine = LLMEngine(EngineConfig(model_path=str(qwen25_dir), backend=backend))
    assert (engine.runner.vision.module is not None) if backend == "native" else True
    g = GenerationConfig(max_new_tokens=6, min_new_tokens=6, temperature=1.0, top_k=0, seed=5)
    outs = engine.generate([ModelRequest(ids, g, rid=f"r{i}", images=images)
                            for i, (ids, images) in enumerate(prompts)])
    samples = []
    for (ids, images), out in zip(prompts, outs):
        assert len(out.output_tokens) == 6
        s = Sample.from_prompt_and_completion(ids, out.output_tokens, out.output_logprobs,
                                              out.output_versions)
        s.images = images
        samples.append(s)
    model = load_causal_lm(qwen25_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    trainer = HFTrainEngine(model, TrainEngineConfig(device="cpu"), trainable=False)
    for s, lp in zip(samples, trainer.forward(samples)):
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(lp[mask], torch.tensor(s.logprobs)[mask], atol=1e-4, rtol=0)
