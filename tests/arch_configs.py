"""Tiny random instances of the architectures the built-in engine serves natively, built from
transformers' own config classes (tests/test_engine_archs.py, tests/integration/test_vllm_archs.py).
"""

from __future__ import annotations

import transformers

VOCAB = 320  # the tiny byte tokenizer's 261 ids, padded
SMALL = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=256, max_position_embeddings=128,
             tie_word_embeddings=True)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}


def configs() -> dict[str, transformers.PretrainedConfig]:
    """Tiny instances (head_dim 32: the C++ kernels serve it) with windows of 8 positions."""
    return {
        "qwen3": transformers.Qwen3Config(**SMALL, head_dim=32),
        "llama3": transformers.LlamaConfig(**SMALL, rope_parameters=LLAMA3),
        "gemma3": transformers.Gemma3TextConfig(
            **SMALL, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0,
                                   "rope_theta": 1000000.0}}),
        "mistral": transformers.MistralConfig(**SMALL, head_dim=32, sliding_window=8),
        "qwen2-sliding": transformers.Qwen2Config(**SMALL, use_sliding_window=True,
                                                  sliding_window=8, max_window_layers=1),
        "llama-linear": transformers.LlamaConfig(
            **SMALL, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
        "llama-yarn": transformers.LlamaConfig(
            **SMALL, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                      "original_max_position_embeddings": 32}),
        # length-dependent ropes: exact while sequences stay within their threshold
        "llama-dynamic": transformers.LlamaConfig(
            **{**SMALL, "max_position_embeddings": 64},
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
        "llama-longrope": transformers.LlamaConfig(
            **SMALL, rope_parameters={
                "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 64,
                "short_factor": [1.0 + 0.05 * i for i in range(16)],
                "long_factor": [2.0 + 0.1 * i for i in range(16)]}),
    }


CONFIGS = configs()
