"""Build the embedded default model: a small random-init Qwen2/Llama with the byte tokenizer.

These machines have no hub access, so tests, examples and the SFT warm start need a model that can
be made from nothing. The result is an ordinary HF directory (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with the chat template) that
`AutoModelForCausalLM.from_pretrained`, vLLM and our own engine load like any real checkpoint, so
every code path exercised on the tiny model is the one used on Qwen/Llama on GPUs.

With the defaults (qwen2, hidden 256, 8 layers, 4 heads / 2 KV heads, MLP 768, vocab 261 padded to
320, tied embeddings) the model has 6,381,824 parameters (~6.4M, ~26 MB in float32).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from asyncrl.models.config import TinyModelConfig
from asyncrl.models.export import save_model_dir
from asyncrl.models.tokenizer import (
    ENDOFTEXT_ID,
    IM_END_ID,
    PAD_ID,
    build_byte_tokenizer,
)

# Mapping, not an if/elif tower: adding an architecture is one line.
ARCH_CONFIGS: dict[str, tuple[type[PretrainedConfig], str]] = {
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "llama": (LlamaConfig, "LlamaForCausalLM"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


def tiny_hf_config(cfg: TinyModelConfig, vocab_size: int) -> PretrainedConfig:
    """The transformers config of the tiny model; ids match `build_byte_tokenizer`."""
    config_cls, architecture = ARCH_CONFIGS[cfg.arch]
    return config_cls(
        vocab_size=padded_vocab_size(vocab_size, cfg.vocab_multiple),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        architectures=[architecture],
        dtype=cfg.dtype,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=PAD_ID,
    )


def build_tiny_model_in_memory(
    cfg: TinyModelConfig,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Random-init model + tokenizer; the same `cfg` (seed included) gives identical weights."""
    tokenizer = build_byte_tokenizer()
    hf_config = tiny_hf_config(cfg, len(tokenizer))
    # A private generator state would be cleaner, but HF init draws from the global RNG; restore
    # it afterwards so building a model does not perturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=DTYPES[cfg.dtype])
    model.generation_config = GenerationConfig(
        bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID, pad_token_id=PAD_ID
    )
    model.eval()
    return model, tokenizer


def build_tiny_model(cfg: TinyModelConfig, out_dir: str | Path) -> Path:
    """Build the tiny model + byte tokenizer and save them as a HF directory at `out_dir`
    (a text arch; qwen2_vl is models/tiny_vl.py's: `loading.build_embedded_model` picks)."""
    model, tokenizer = build_tiny_model_in_memory(cfg)
    return save_model_dir(model, tokenizer, out_dir)
