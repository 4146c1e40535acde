"""Tiny random instances of the architectures the built-in engine serves natively, built from
transformers' own config classes (tests/test_engine_archs.py, tests/integration/test_vllm_archs.py).
"""

from __future__ import annotations

import torch
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
        # mixture of experts: 4 experts, top 2; Qwen3-MoE's middle layer dense
        "qwen3-moe": transformers.Qwen3MoeConfig(
            **SMALL, head_dim=32, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=64, mlp_only_layers=[1], norm_topk_prob=True),
        "mixtral": transformers.MixtralConfig(**{**SMALL, "intermediate_size": 64}, head_dim=32,
                                              num_local_experts=4, num_experts_per_tok=2),
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


def build_instances(names, tmp_path_factory) -> dict:
    """{name: (model dir, transformers model)}: the `names` instances, seeded by their place in
    `names`, saved with the tiny byte tokenizer (a module-scoped fixture's body)."""
    from asyncrl.models.tokenizer import build_byte_tokenizer, save_tokenizer

    out = {}
    for i, name in enumerate(names):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]).eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        save_tokenizer(build_byte_tokenizer(), path)
        out[name] = (path, model)
    return out


def three_step_job(path, run_dir) -> list[str]:
    """Overrides of a 3-step `asyncrl train` of the model at `path` on the CPU (digits reward,
    groups of 4, 6 new tokens, no evals or checkpoints)."""
    return [f"model.path={path}", f"output_dir={run_dir}", "total_steps=3",
            "max_train_seconds=null", "gconfig.n_samples=4", "gconfig.max_new_tokens=6",
            "rollout.batch_size=2", "rollout.max_concurrent_rollouts=8", "reward=digits",
            "filter_uniform_groups=false", "eval.every=0", "checkpoint_every=0",
            "logging.tensorboard=false", "inference.engine.max_seq_len=64",
            "inference.engine.device=cpu", "train.device=cpu", "data.num_train=16",
            "data.num_eval=8"]
