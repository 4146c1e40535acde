"""The train engine on a vision-language model (the embedded tiny Qwen2-VL): samples carry their
prompt's images through packing and micro-batching, per-token logprobs equal transformers' own
forward of each sample (fp32), gradients reach the vision tower, LoRA trains the language model
with images in the prompt, and a packed layout is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from asyncrl.api import Sample
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.presets import build_preset_model
from asyncrl.models.vision import VisionPromptEncoder
from asyncrl.models.tiny_vl import IMAGE_PAD_ID, VISION_START_ID
from asyncrl.train.config import LoraConfig, OptimizerConfig, TrainEngineConfig
from asyncrl.train.engine import HFTrainEngine, sft_token_loss

QUESTION = {"type": "text", "text": "How many objects are there?"}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_preset_model("tiny-vl", tmp_path_factory.mktemp("tiny-vl"))


def scene(n: int, size=(112, 112)) -> Image.Image:
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    for k in range(n):
        draw.ellipse((8 + 30 * k, 20, 30 + 30 * k, 42), fill=("red", "blue", "green")[k % 3])
    return img


@pytest.fixture(scope="module")
def samples(vl_dir):
    """Two prompts (different images, one of them smaller) x two completions each."""
    encoder = VisionPromptEncoder.from_model_dir(vl_dir)
    out = []
    for n, size in ((2, (112, 112)), (3, (112, 56))):
        prompt = encoder.encode([{"role": "user", "content": [{"type": "image"}, QUESTION]}],
                                [scene(n, size)])
        for completion in ([ord(str(n)) - 27, 3], [21, 22, 23, 3]):  # char ids of digits, EOS
            s = Sample.from_prompt_and_completion(prompt.input_ids, completion,
                                                  [-1.0] * len(completion), [0] * len(completion))
            s.images = prompt.image_inputs()
            out.append(s)
    return out


def reference_logprobs(model, sample: Sample) -> torch.Tensor:
    """transformers' forward of one sample alone: input-aligned logprobs (0 at t = 0)."""
    ids = torch.tensor([sample.input_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                       pixel_values=sample.images.pixel_values,
                       image_grid_thw=sample.images.grid_thw,
                       mm_token_type_ids=(ids == model.config.image_token_id).long()).logits[0]
    lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


def engine(vl_dir, lora: LoraConfig | None = None, **cfg) -> HFTrainEngine:
    return HFTrainEngine(load_causal_lm(vl_dir), TrainEngineConfig(
        device="cpu", optimizer=OptimizerConfig(lr=1e-2), **cfg), lora=lora)


@pytest.mark.parametrize("max_tokens", [10_000, 80])  # one micro-batch; one sample each
def test_logprobs_with_images_equal_transformers(vl_dir, samples, max_tokens):
    ours = engine(vl_dir, max_tokens_per_mb=max_tokens).forward(samples)
    model = load_causal_lm(vl_dir)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    for sample, got in zip(samples, ours):
        want = reference_logprobs(model, sample)
        completion = torch.tensor(sample.loss_mask, dtype=torch.bool)
        assert torch.allclose(got[completion], want[completion], atol=1e-5), (got, want)


def test_gradients_reach_the_vision_tower(vl_dir, samples):
    eng = engine(vl_dir)
    before = {k: v.clone() for k, v in eng.model.named_parameters() if ".visual." in f".{k}"}
    assert before, "the model has a vision tower"
    stats = eng.train_batch(samples, sft_token_loss)
    assert stats["train/micro_batches"] == 1.0 and torch.isfinite(torch.tensor(stats["train/loss"]))
    moved = [k for k, v in eng.model.named_parameters() if k in before
             and not torch.equal(v, before[k])]
    assert len(moved) == len(before)


def test_lora_trains_the_language_model_with_images(vl_dir, samples):
    eng = engine(vl_dir, lora=LoraConfig(r=4))  # the default targets: the decoder's linears
    adapted = [k for k, p in eng.model.named_parameters() if p.requires_grad]
    assert adapted and all("lora_" in k and ".visual." not in k for k in adapted)
    first = eng.train_batch(samples, sft_token_loss)["train/loss"]
    for _ in range(5):
        last = eng.train_batch(samples, sft_token_loss)["train/loss"]
    assert last < first


def test_a_packed_layout_is_refused_for_images(vl_dir, samples):
    with pytest.raises(ValueError, match="attention_layout padded"):
        engine(vl_dir, attention_layout="packed").forward(samples)


def test_a_generated_vision_token_is_read_as_text(vl_dir, samples):
    """A sampled <|image_pad|> or <|vision_start|> is no placeholder: it is read back as id 0
    (models/vision.py vlm_forward_kwargs), not counted against the prompt's images."""
    base = samples[0]
    prompt_len = base.loss_mask.index(1)
    stray = Sample.from_prompt_and_completion(base.input_ids[:prompt_len], [IMAGE_PAD_ID, VISION_START_ID, 24, 3],
                                              [-1.0] * 4, [0] * 4)
    stray.images = base.images
    got = engine(vl_dir).forward([stray])[0]
    as_text = Sample.from_prompt_and_completion(base.input_ids[:prompt_len], [0, 0, 24, 3],
                                                [-1.0] * 4, [0] * 4)
    as_text.images = base.images
    want = reference_logprobs(load_causal_lm(vl_dir), as_text)
    # the stray tokens' own logprobs are of themselves; what follows them is read as after id 0
    torch.testing.assert_close(got[prompt_len + 2:], want[prompt_len + 2:], atol=1e-5, rtol=0)
