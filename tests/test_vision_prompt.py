"""Multimodal prompts (asyncrl/models/vision.py): chat messages with images -> ids with one
<|image_pad|> per merged patch block, pixel patches and grid sizes, for the embedded tiny VLM.
(The ids a real vLLM server builds for the same messages: tests/integration/test_vllm_vision.py.)"""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from asyncrl.models.presets import build_preset_model
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.models.vision import VisionPromptEncoder, load_image, message_images

QUESTION = {"type": "text", "text": "How many?"}


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return VisionPromptEncoder.from_model_dir(
        build_preset_model("tiny-vl", tmp_path_factory.mktemp("tiny-vl")))


def picture(size=(112, 112), colour="red") -> Image.Image:
    return Image.new("RGB", size, colour)


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_each_image_becomes_one_pad_per_merged_patch_block(encoder):
    small, wide = picture((56, 56)), picture((112, 56), "blue")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, QUESTION]}]
    prompt = encoder.encode(messages, [small, wide])
    assert prompt.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 8]]
    assert prompt.pixel_values.shape == (16 + 32, 3 * 2 * 14 * 14)
    ids = prompt.input_ids
    assert ids.count(encoder.pad_id) == 4 + 8 and prompt.num_images == 2
    text = encoder.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4
                           + "<|vision_end|><|vision_start|>" + "<|image_pad|>" * 8)
    assert text.endswith("<|vision_end|>How many?<|im_end|>\n<|im_start|>assistant\n")


def test_every_image_form_gives_the_same_prompt(encoder, tmp_path):
    img = picture(colour="green")
    (tmp_path / "a.png").write_bytes(png(img))
    url = "data:image/png;base64," + base64.b64encode(png(img)).decode()
    forms = [img, str(tmp_path / "a.png"), png(img), url, {"bytes": png(img), "path": None},
             {"path": str(tmp_path / "a.png")}]
    prompts = [encoder.encode([{"role": "user", "content": [{"type": "image", "image": f},
                                                            QUESTION]}]) for f in forms]
    prompts.append(encoder.encode([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, QUESTION]}]))
    for p in prompts[1:]:
        assert p.input_ids == prompts[0].input_ids
        assert torch.equal(p.pixel_values, prompts[0].pixel_values)


def test_text_only_messages_have_no_pixels(encoder):
    prompt = encoder.encode([{"role": "user", "content": "1+2="}])
    assert prompt.num_images == 0 and encoder.pad_id not in prompt.input_ids


def test_bad_images_are_clear_errors(encoder, tmp_path):
    one_image = [{"role": "user", "content": [{"type": "image"}, QUESTION]}]
    with pytest.raises(ValueError, match="no payload and no image is left of the 0 given"):
        encoder.encode(one_image)
    with pytest.raises(ValueError, match="2 images given but the messages have only 1"):
        message_images(one_image, [picture(), picture()])
    with pytest.raises(ValueError, match=r"\(9 bytes\) cannot be decoded"):
        load_image(b"not a png")
    with pytest.raises(ValueError, match="cannot be decoded"):
        load_image(str(tmp_path / "missing.png"))
    with pytest.raises(ValueError, match="allowed a PIL image"):
        load_image(3)
    with pytest.raises(ValueError, match="only base64"):
        load_image("data:image/png,abc")


def test_a_text_only_model_is_refused(tmp_path):
    text_dir = build_tiny_model(TinyModelConfig(), tmp_path / "text")
    with pytest.raises(ValueError, match="not a vision-language model"):
        VisionPromptEncoder.from_model_dir(text_dir)
