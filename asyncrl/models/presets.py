"""Model presets: the tiny default and random-init models shaped like Qwen2.5-0.5B / 1.5B.

No hub access here, yet GPU benchmarks and real-size tests need models of the real shapes. A
preset is the published architecture (hidden size, layers, heads, MLP width, vocabulary, RoPE,
norms, tied embeddings) of Qwen2.5, built with seeded random weights and the locally built
Qwen2.5-layout BPE tokenizer (bpe_tokenizer.py), then saved as an ordinary HF directory
(config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json)
that transformers, vLLM and our engine load like the real checkpoint. The weights are random,
so outputs are noise; throughput, memory and weight-sync costs are the real ones.

Numbers (Qwen/Qwen2.5-{0.5B,1.5B}[-Instruct] config.json): 0.5B has 494,032,768 parameters,
1.5B has 1,543,714,304 (tied embeddings counted once). max_position_embeddings is 32,768, the
Instruct models' value (the 1.5B base config says 131,072).
"""

from __future__ import annotations

import difflib
import hashlib
from pathlib import Path
from typing import Literal

import pydantic
import torch

from asyncrl.config import Config
from asyncrl.models.tiny import DTYPES

DType = Literal["float32", "bfloat16", "float16"]
# Part of the cache key: bump when the built directory changes for the same preset and seed.
PRESET_BUILD_VERSION = 1


class ArchPreset(Config):
    """A Qwen2 architecture; field names follow transformers' Qwen2Config."""

    hidden_size: int = pydantic.Field(ge=8)
    num_hidden_layers: int = pydantic.Field(ge=1)
    num_attention_heads: int = pydantic.Field(ge=1)
    num_key_value_heads: int = pydantic.Field(ge=1)
    intermediate_size: int = pydantic.Field(ge=1)
    vocab_size: int = pydantic.Field(ge=1)
    max_position_embeddings: int = pydantic.Field(ge=16)
    rope_theta: float = pydantic.Field(gt=0)
    rms_norm_eps: float = pydantic.Field(gt=0)
    tie_word_embeddings: bool
    default_dtype: DType = "bfloat16"


QWEN25_VOCAB = 151_936  # embedding rows; the tokenizer uses the first 151,665
PRESETS: dict[str, ArchPreset] = {
    "qwen2.5-0.5b": ArchPreset(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=QWEN25_VOCAB, max_position_embeddings=32_768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-1.5b": ArchPreset(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=QWEN25_VOCAB, max_position_embeddings=32_768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
TINY = "tiny"  # the embedded default (models/tiny.py), with its byte tokenizer
TINY_VL = "tiny-vl"  # the embedded vision-language model (models/tiny_vl.py), a small Qwen2-VL
# the presets that are the embedded model, by its arch (TinyModelConfig.arch)
TINY_ARCHS = {TINY: "qwen2", TINY_VL: "qwen2_vl", "tiny-qwen3-vl": "qwen3_vl",
              "tiny-moe": "qwen3_moe"}
PRESET_NAMES = (*TINY_ARCHS, *PRESETS)


def check_preset(name: str) -> str:
    """`name` if it is a preset, else ValueError naming the allowed ones (and a close match)."""
    if name in PRESET_NAMES:
        return name
    close = difflib.get_close_matches(name, PRESET_NAMES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"preset={name!r} is not known; allowed {list(PRESET_NAMES)}{hint}")


def check_dtype(dtype: str | None, name: str) -> str:
    """The dtype to build `name` in: `dtype`, or the preset's default when None."""
    if dtype is None:
        return "float32" if name in TINY_ARCHS else PRESETS[name].default_dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed {list(DTYPES)}")
    return dtype


def preset_hf_config(name: str, dtype: str | None = None):
    """The transformers config of a Qwen2.5 preset; token ids are the BPE tokenizer's."""
    from transformers import Qwen2Config

    from asyncrl.models.bpe_tokenizer import ENDOFTEXT_ID, IM_END_ID

    if check_preset(name) in TINY_ARCHS:
        raise ValueError(f"preset={name!r} is not a Qwen2.5 preset; see models/tiny.py and "
                         "models/tiny_vl.py")
    arch = PRESETS[name]
    return Qwen2Config(
        **arch.model_dump(exclude={"default_dtype"}),
        hidden_act="silu",
        initializer_range=0.02,
        attention_dropout=0.0,
        use_sliding_window=False,
        max_window_layers=arch.num_hidden_layers,
        architectures=["Qwen2ForCausalLM"],
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        dtype=check_dtype(dtype, name),
    )


def build_preset_in_memory(name: str, dtype: str | None = None, seed: int = 0):
    """(model, tokenizer) of a Qwen2.5 preset; the same name, dtype and seed give the same weights.

    The model is created directly in `dtype` (no float32 copy: ~1 GB peak for 0.5B in bf16)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from asyncrl.models.bpe_tokenizer import ENDOFTEXT_ID, IM_END_ID, load_bpe_tokenizer

    hf_config = preset_hf_config(name, dtype)
    tokenizer = load_bpe_tokenizer()
    # HF init draws from the global RNG; keep the caller's random stream untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=DTYPES[check_dtype(dtype, name)])
    # As Qwen2.5-Instruct: a chat turn ends at <|im_end|>, a document at <|endoftext|>.
    model.generation_config = GenerationConfig(
        bos_token_id=ENDOFTEXT_ID, eos_token_id=[IM_END_ID, ENDOFTEXT_ID],
        pad_token_id=ENDOFTEXT_ID)
    return model.eval(), tokenizer


def build_preset_model(name: str, out_dir: str | Path, dtype: str | None = None,
                       seed: int = 0) -> Path:
    """Build preset `name` and save it as a HF directory at `out_dir`."""
    from asyncrl.models.export import save_model_dir
    from asyncrl.models.loading import build_embedded_model
    from asyncrl.models.config import TinyModelConfig

    if check_preset(name) in TINY_ARCHS:
        tiny = TinyModelConfig(arch=TINY_ARCHS[name], dtype=check_dtype(dtype, name), seed=seed)
        return build_embedded_model(tiny, out_dir)
    model, tokenizer = build_preset_in_memory(name, dtype, seed)
    return save_model_dir(model, tokenizer, out_dir)


def preset_model_dir(name: str, dtype: str | None = None, seed: int = 0) -> Path:
    """Where `ensure_preset_model` caches preset `name` (keyed by the build version, the preset's
    numbers, the dtype, the seed and, for Qwen presets, the tokenizer's corpus digest)."""
    from asyncrl.models.loading import cache_root, default_model_dir
    from asyncrl.models.config import TinyModelConfig

    dtype = check_dtype(dtype, check_preset(name))
    if name in TINY_ARCHS:
        return default_model_dir(TinyModelConfig(arch=TINY_ARCHS[name], dtype=dtype, seed=seed))
    from asyncrl.models.bpe_tokenizer import bpe_tokenizer_dir

    payload = (f"v{PRESET_BUILD_VERSION}\n{PRESETS[name].to_yaml()}\n{dtype}\n{seed}\n"
               f"{bpe_tokenizer_dir().name}")
    key = hashlib.sha256(payload.encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{name}-{dtype}-{key}"


def ensure_preset_model(name: str, dtype: str | None = None, seed: int = 0) -> Path:
    """The cached model directory of preset `name`, built first if absent."""
    from asyncrl.models.loading import build_once, ensure_tiny_model
    from asyncrl.models.config import TinyModelConfig

    dtype = check_dtype(dtype, check_preset(name))
    if name in TINY_ARCHS:
        return ensure_tiny_model(TinyModelConfig(arch=TINY_ARCHS[name], dtype=dtype, seed=seed))
    return build_once(preset_model_dir(name, dtype, seed), "config.json",
                      lambda tmp: build_preset_model(name, tmp, dtype, seed))
