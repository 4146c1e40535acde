"""Build the embedded default model: a small random-init Qwen2/Llama (or a Qwen3-MoE) with the
byte tokenizer.

These machines have no hub access, so tests, examples and the SFT warm start need a model that can
be made from nothing. The result is an ordinary HF directory (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with the chat template) that
`AutoModelForCausalLM.from_pretrained`, vLLM and our own engine load like any real checkpoint, so
every code path exercised on the tiny model is the one used on Qwen/Llama on GPUs.

With the defaults (qwen2, hidden 256, 8 layers, 4 heads / 2 KV heads, MLP 768, vocab 261 padded to
320, tied embeddings) the model has 6,381,824 parameters (~6.4M, ~26 MB in float32).

The random init (`seeded_init`) draws every weight as the model of the ASCII vocabulary alone
(the special tokens, "\n" and printable ASCII: ids 0-100, padded to 128 rows) would, then the
embedding rows of the other byte tokens from a generator of their own: the init of everything the
embedded tasks use does not depend on how many other tokens the tokenizer has. (How much of the
arithmetic a 600-step warm start learns depends on its init and on the CPU's float sums: the
main job's warm start ships with the package, asyncrl/warm_starts/, rather than being retrained
on each machine.)
"""

from __future__ import annotations

from collections.abc import Callable
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
    Qwen3MoeConfig,
)

from asyncrl.models.config import MOE_ARCHS, TinyModelConfig
from asyncrl.models.export import save_model_dir
from asyncrl.models.tokenizer import (
    CHARACTERS,
    ENDOFTEXT_ID,
    IM_END_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    build_byte_tokenizer,
)

# Mapping, not an if/elif tower: adding an architecture is one line.
ARCH_CONFIGS: dict[str, tuple[type[PretrainedConfig], str]] = {
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ASCII_VOCAB = len(SPECIAL_TOKENS) + len(CHARACTERS)  # ids 0..100: what the embedded tasks write


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


def tiny_hf_config(cfg: TinyModelConfig, vocab_size: int) -> PretrainedConfig:
    """The transformers config of the tiny model; ids match `build_byte_tokenizer`."""
    config_cls, architecture = ARCH_CONFIGS[cfg.arch]
    experts = {} if cfg.arch not in MOE_ARCHS else dict(
        num_experts=cfg.experts, num_experts_per_tok=cfg.top_k, norm_topk_prob=True,
        moe_intermediate_size=cfg.intermediate_size // cfg.top_k,
        head_dim=cfg.hidden_size // cfg.num_heads)
    return config_cls(
        **experts,
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
    model = seeded_init(lambda vocab: AutoModelForCausalLM.from_config(
        tiny_hf_config(cfg, vocab), dtype=DTYPES[cfg.dtype]), len(tokenizer), cfg.seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID, pad_token_id=PAD_ID
    )
    model.eval()
    return model, tokenizer


def seeded_init(make: Callable[[int], PreTrainedModel], vocab_size: int, seed: int
                ) -> PreTrainedModel:
    """`make(vocab_size)` with the module docstring's init: the weights `make(ASCII_VOCAB)` gets
    from `seed`, the embedding rows past them drawn from their own generator (normal, the
    config's initializer_range). HF init draws from the global RNG; it is restored afterwards,
    so building a model does not perturb the caller's random stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ascii_model = make(ASCII_VOCAB)
        model = make(vocab_size)
    text = model.config.get_text_config()
    state = ascii_model.state_dict()
    if text.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding's own parameter
    rows = ascii_model.get_input_embeddings().weight.shape[0]
    extra = model.get_input_embeddings().weight.shape[0] - rows
    g = torch.Generator().manual_seed(seed + 1)
    for name, tensor in state.items():
        if tensor.dim() == 2 and tensor.shape[0] == rows and (
                "embed_tokens" in name or name == "lm_head.weight"):
            more = torch.randn(extra, tensor.shape[1], generator=g) * text.initializer_range
            state[name] = torch.cat([tensor, more.to(tensor.dtype)])
    missing = set(model.load_state_dict(state, strict=False).missing_keys) - {"lm_head.weight"}
    if missing:
        raise RuntimeError(f"seeded_init left {sorted(missing)[:3]} unset")
    return model


def build_tiny_model(cfg: TinyModelConfig, out_dir: str | Path) -> Path:
    """Build the tiny model + byte tokenizer and save them as a HF directory at `out_dir`
    (a text arch; qwen2_vl is models/tiny_vl.py's: `loading.build_embedded_model` picks)."""
    model, tokenizer = build_tiny_model_in_memory(cfg)
    return save_model_dir(model, tokenizer, out_dir)
