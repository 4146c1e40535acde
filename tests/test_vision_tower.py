"""The compact engine's image side (inference/vision_tower.py) against transformers: M-RoPE
positions and rope deltas equal `get_rope_index` of Qwen2-VL and Qwen2.5-VL (what the trainer
uses) for one image, several images of different sizes and a text-only prompt; configs of both
transformers generations map to the decoder's; weight names route to the vision module or the
decoder."""

from __future__ import annotations

import pytest
import torch

from asyncrl.inference.vision_tower import language_config, mrope_positions
from asyncrl.models.weight_names import spellings, split_vlm_name

IMG, START, END = 103, 101, 102


def prompt(grids, merge=2, text=3):
    ids = [7] * text
    for t, h, w in grids:
        ids += [START] + [IMG] * (t * h * w // merge ** 2) + [END] + [9] * 2
    return ids + [11, 12]


@pytest.fixture(scope="module")
def rope_index_fns():
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    fns = []
    for cls, cfg_cls in ((Qwen2VLModel, Qwen2VLConfig), (Qwen2_5_VLModel, Qwen2_5_VLConfig)):
        cfg = cfg_cls(text_config=dict(hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1,
                                       intermediate_size=64, vocab_size=128),
                      vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                         spatial_merge_size=2),
                      image_token_id=IMG, video_token_id=104, vision_start_token_id=START,
                      vision_end_token_id=END)
        fns.append(cls(cfg).get_rope_index)
    return fns


@pytest.mark.parametrize("grids", [[(1, 8, 8)], [(1, 4, 8), (1, 10, 6)], [(1, 2, 2)] * 3])
def test_mrope_positions_equal_transformers_get_rope_index(rope_index_fns, grids):
    ids = prompt(grids)
    streams, delta = mrope_positions(ids, IMG, grids, 2)
    t = torch.tensor([ids])
    for get_rope_index in rope_index_fns:
        want, want_delta = get_rope_index(t, mm_token_type_ids=(t == IMG).int(),
                                          image_grid_thw=torch.tensor(grids))
        assert streams == want[:, 0].tolist() and delta == int(want_delta)


def test_a_text_prompt_counts_up_in_every_stream():
    streams, delta = mrope_positions([5, 6, 7, 8], IMG, [], 2)
    assert streams == [[0, 1, 2, 3]] * 3 and delta == 0


def test_an_image_run_must_match_its_grid():
    with pytest.raises(ValueError, match=r"does not match its grid \(1, 2, 2\)"):
        mrope_positions([5, IMG, IMG, IMG, 6], IMG, [(1, 4, 4)], 2)


def test_both_config_generations_map_to_the_decoders():
    new = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
           "tie_word_embeddings": True, "vision_config": {"depth": 2},
           "text_config": {"hidden_size": 256, "model_type": "qwen2_vl_text",
                           "rope_parameters": {"mrope_section": [8, 12, 12], "rope_theta": 1e4,
                                               "rope_type": "default", "type": "mrope"}}}
    old = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "hidden_size": 256,
           "model_type": "qwen2_5_vl", "rope_theta": 1e6, "vision_config": {"depth": 2},
           "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
    a, b = language_config(new), language_config(old)
    assert a["architectures"] == b["architectures"] == ["Qwen2ForCausalLM"]
    assert a["mrope_section"] == [8, 12, 12] and b["mrope_section"] == [16, 24, 24]
    assert a["rope_parameters"] == {"rope_theta": 1e4, "rope_type": "default"}
    assert b["rope_parameters"] == {"rope_type": "default"} and b["rope_theta"] == 1e6
    assert a["hidden_size"] == 256 and a["tie_word_embeddings"] and not b["tie_word_embeddings"]
    text = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 8}
    assert language_config(text) == text


def test_weight_names_route_to_the_vision_module_or_the_decoder():
    assert split_vlm_name("model.visual.blocks.0.attn.qkv.weight") == (
        "vision", "blocks.0.attn.qkv.weight")
    assert split_vlm_name("visual.merger.mlp.0.bias") == ("vision", "merger.mlp.0.bias")
    assert split_vlm_name("model.language_model.layers.1.mlp.up_proj.weight") == (
        "language", "model.layers.1.mlp.up_proj.weight")
    assert split_vlm_name("model.layers.1.mlp.up_proj.weight") == (
        "language", "model.layers.1.mlp.up_proj.weight")
    assert split_vlm_name("lm_head.weight") == ("language", "lm_head.weight")
    # a checkpoint may spell an in-memory name either way (LoRA reads base weights by them)
    assert spellings("model.language_model.layers.0.mlp.up_proj.weight") == [
        "model.language_model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight",
        "language_model.model.layers.0.mlp.up_proj.weight"]
    assert spellings("model.visual.merger.mlp.0.bias") == ["model.visual.merger.mlp.0.bias",
                                                           "visual.merger.mlp.0.bias"]
    assert spellings("lm_head.weight") == ["lm_head.weight"]
