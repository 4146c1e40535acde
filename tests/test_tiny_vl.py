"""The embedded vision-language model (`asyncrl build-model --preset tiny-vl`): a small Qwen2-VL
that transformers loads like the real one, with a tokenizer and template that place images."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from asyncrl.models.presets import build_preset_model, check_preset
from asyncrl.models.tokenizer import build_byte_tokenizer
from asyncrl.models.tiny_vl import IMAGE_PAD_ID, VISION_START_ID

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_preset_model("tiny-vl", tmp_path_factory.mktemp("tiny-vl"))


def scene(shapes: list[tuple[str, tuple[int, int, int, int], str]]) -> Image.Image:
    img = Image.new("RGB", (112, 112), "white")
    draw = ImageDraw.Draw(img)
    for kind, box, colour in shapes:
        (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=colour)
    return img


def model_inputs(vl_dir, image: Image.Image, question: str = "How many objects are there?"):
    """What Qwen2-VL's processor builds: the placeholder expanded to one <|image_pad|> per
    merged 2 x 2 patch block, pixel patches, grid sizes and the per-token modality ids."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(vl_dir)
    images = transformers.AutoImageProcessor.from_pretrained(vl_dir)(images=[image],
                                                                      return_tensors="pt")
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": question}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pads = int(images["image_grid_thw"][0].prod()) // 4
    ids = tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * pads),
                    return_tensors="pt")["input_ids"]
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return text, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "mm_token_type_ids": (ids == image_id).long(), **images}


def test_tiny_vl_is_a_qwen2_vl_that_transformers_loads_and_runs(vl_dir):
    assert check_preset("tiny-vl") == "tiny-vl"
    model = transformers.AutoModelForImageTextToText.from_pretrained(vl_dir).eval()
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert model.config.image_token_id == IMAGE_PAD_ID == 263
    assert model.config.vision_start_token_id == VISION_START_ID == 261
    text, inputs = model_inputs(vl_dir, scene([("circle", (10, 10, 40, 40), "red")]))
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many "
                    "objects are there?<|im_end|>\n<|im_start|>assistant\n")
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]]  # 112 px / 14 -> 64 patches
    assert int(inputs["mm_token_type_ids"].sum()) == 16  # 2 x 2 merged -> 16 image tokens
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], 320)  # 265 ids padded
    assert torch.isfinite(logits).all()
    # the image reaches the answer: another scene, other next-token logits
    _, other = model_inputs(vl_dir, scene([("square", (50, 50, 100, 100), "blue"),
                                           ("circle", (5, 5, 30, 30), "green")]))
    with torch.no_grad():
        assert not torch.allclose(model(**other).logits[0, -1], logits[0, -1])
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, inputs["input_ids"].shape[1] + 4)


def test_tiny_vl_tokenizer_renders_text_as_the_text_model_does(vl_dir):
    vl = transformers.AutoTokenizer.from_pretrained(vl_dir)
    text = build_byte_tokenizer()
    messages = [{"role": "user", "content": "1+2="},
                {"role": "assistant", "content": [{"type": "text", "text": "3"}]}]
    assert vl.apply_chat_template(messages, tokenize=False) == text.apply_chat_template(
        messages, tokenize=False)
    assert vl("1+2= é")["input_ids"] == text("1+2= é")["input_ids"]  # ids 0-260 unchanged
    assert vl.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                     "<|video_pad|>"]) == [261, 262, 263, 264]


def test_unknown_preset_names_tiny_vl_among_the_allowed():
    with pytest.raises(ValueError, match="tiny-vl"):
        check_preset("tiny_vl")
