"""Build the embedded vision-language model: a small random-init Qwen2-VL (or, with arch qwen3_vl,
a Qwen3-VL: `tiny_qwen3_vl_config`) with the byte tokenizer.

The text side has the tiny model's shape (`TinyModelConfig` with arch qwen2_vl; by default hidden
256, 8 layers, 4 heads / 2 KV heads, MLP 768, tied embeddings) with multimodal RoPE (M-RoPE: the
rotary pairs of a head split 1/4 time, 3/8 height, 3/8 width, so 8/12/12 of 32); the vision tower is Qwen2-VL's (14 px patches, 2 frames per temporal patch, 2 x 2
patches merged into one token) at width 64 and depth 2. The tokenizer is the tiny byte tokenizer
plus Qwen2-VL's vision tokens (<|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>,
ids 261-264), and its chat template renders an image part as the placeholder
<|vision_start|><|image_pad|><|vision_end|>. The image processor is Qwen2-VL's, capped at 112 x 112
pixels, so an image costs at most 64 patches -> 16 tokens. The weights are drawn as tiny.py's
`seeded_init` says (the ASCII vocabulary's init first).

The result is an ordinary HF directory (config.json, model.safetensors, generation_config.json,
tokenizer files, preprocessor_config.json) that transformers' image-text-to-text classes load as
they load Qwen2-VL. transformers' combined Qwen2-VL processor also wants a video processor, which
needs torchvision; this machine's CPU torch has no matching torchvision build, so the directory
holds the image processor and the tokenizer, each loadable on its own (AutoImageProcessor,
AutoTokenizer).
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.models.config import TinyModelConfig
from asyncrl.models.tiny import DTYPES, padded_vocab_size, seeded_init
from asyncrl.models.tokenizer import (
    ENDOFTEXT_ID,
    IM_END_ID,
    PAD_ID,
    TEXT_OR_IMAGE_PART,
    VOCAB_SIZE,
    build_byte_tokenizer,
    chat_template,
)

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# added after the byte vocabulary, in this order
VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = range(VOCAB_SIZE, VOCAB_SIZE + 4)
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
QWEN3_PATCH_SIZE = 16  # Qwen3-VL's patches
MAX_IMAGE_PIXELS = 112 * 112  # 8 x 8 patches -> 16 image tokens
MIN_IMAGE_PIXELS = 56 * 56


def build_vl_tokenizer():
    """The tiny byte tokenizer with Qwen2-VL's vision tokens and the image-aware template."""
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = chat_template(TEXT_OR_IMAGE_PART)
    return tokenizer


def mrope_sections(head_dim: int) -> list[int]:
    """Qwen2-VL's split of a head's rotary pairs over (time, height, width): 16/24/24 of 64."""
    half = head_dim // 2
    t = half // 4
    return [t, (half - t) // 2, half - t - (half - t) // 2]


def tiny_vl_config(tokenizer, cfg: TinyModelConfig, vocab_size: int | None = None):
    """The config of the tiny VLM (Qwen2-VL's, or Qwen3-VL's for arch qwen3_vl); `vocab_size`:
    the text vocabulary before padding (None: the tokenizer's)."""
    from transformers import Qwen2VLConfig

    if cfg.arch == "qwen3_vl":
        return tiny_qwen3_vl_config(tokenizer, cfg, vocab_size)
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=padded_vocab_size(vocab_size or len(tokenizer), cfg.vocab_multiple),
            hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
            intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
            rope_scaling={"type": "mrope",
                          "mrope_section": mrope_sections(cfg.hidden_size // cfg.num_heads)},
            tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=ENDOFTEXT_ID,
            eos_token_id=IM_END_ID, pad_token_id=PAD_ID),
        vision_config=dict(
            depth=2, embed_dim=64, hidden_size=cfg.hidden_size, num_heads=4, mlp_ratio=2,
            patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
            temporal_patch_size=TEMPORAL_PATCH_SIZE, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=cfg.tie_word_embeddings,
        architectures=["Qwen2VLForConditionalGeneration"], dtype=cfg.dtype)


def tiny_qwen3_vl_config(tokenizer, cfg: TinyModelConfig, vocab_size: int | None = None):
    """Qwen3-VL's config of the tiny VLM: a Qwen3 decoder (q/k norms) with interleaved M-RoPE
    (Qwen3-VL's 24/20/20 split of 64 rotary pairs, scaled to the head), and Qwen3-VL's vision
    tower (16 px patches, learned position grid, DeepStack features from both of its blocks into
    the first two decoder layers) at width 64 and depth 2."""
    from transformers import Qwen3VLConfig

    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    head_dim = cfg.hidden_size // cfg.num_heads
    half = head_dim // 2
    h = w = half * 20 // 64
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=padded_vocab_size(vocab_size or len(tokenizer), cfg.vocab_multiple),
            hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
            head_dim=head_dim, intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                             "mrope_interleaved": True, "mrope_section": [half - h - w, h, w]},
            tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=ENDOFTEXT_ID,
            eos_token_id=IM_END_ID, pad_token_id=PAD_ID),
        vision_config=dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=4,
            out_hidden_size=cfg.hidden_size, patch_size=QWEN3_PATCH_SIZE,
            spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
            num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=cfg.tie_word_embeddings,
        architectures=["Qwen3VLForConditionalGeneration"], dtype=cfg.dtype)


def build_tiny_vl_model(cfg: TinyModelConfig, out_dir: str | Path) -> Path:
    """Build the tiny VLM (`cfg.seed`'s random weights) and save it as a HF directory."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from asyncrl.models.export import save_model_dir

    tokenizer = build_vl_tokenizer()
    model = seeded_init(lambda vocab: AutoModelForImageTextToText.from_config(
        tiny_vl_config(tokenizer, cfg, vocab), dtype=DTYPES[cfg.dtype]), len(tokenizer), cfg.seed)
    model.generation_config = GenerationConfig(bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID,
                                               pad_token_id=PAD_ID)
    out = save_model_dir(model.eval(), tokenizer, out_dir)
    save_image_processor(out, QWEN3_PATCH_SIZE if cfg.arch == "qwen3_vl" else PATCH_SIZE)
    return out


def save_image_processor(out: Path, patch_size: int) -> None:
    """Qwen2-VL's image processor, capped at MAX_IMAGE_PIXELS, saved into `out`; recorded as
    "Qwen2VLImageProcessor", a name every transformers version resolves (5.x to its PIL class
    when torchvision is absent)."""
    try:  # transformers 5: the PIL class (the default one needs torchvision)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor,
        )
    except ImportError:  # transformers 4: the default class is the PIL one
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
            Qwen2VLImageProcessor as ImageProcessor,
        )
    ImageProcessor(min_pixels=MIN_IMAGE_PIXELS, max_pixels=MAX_IMAGE_PIXELS,
                   patch_size=patch_size, merge_size=MERGE_SIZE,
                   temporal_patch_size=TEMPORAL_PATCH_SIZE).save_pretrained(out)
