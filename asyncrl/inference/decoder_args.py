"""What the compact decoder needs to know about a checkpoint, read from its HF config.

The compact decoder (`decoder.py`) is one layer loop with a few switches; `ARCHITECTURES` says
which each supported architecture turns on:

- Llama / Llama 3.x, Mistral (a sliding window on every layer when its config sets one): the
  plain pre-norm layer;
- Qwen2 (q/k/v biases; sliding-window layers from `layer_types`), Qwen2-VL / Qwen2.5-VL's
  decoder (vision_tower.py);
- Qwen3: RMSNorm of each query and key head before RoPE;
- Gemma 3 (text): (1 + w) RMSNorms computed in fp32, norms before and after both the attention
  and the MLP, embeddings scaled by sqrt(hidden), query_pre_attn_scalar, tanh-GELU, and
  alternating sliding-window (local RoPE base) and global layers;
- mixture-of-experts MLPs (`MoeArgs`): Qwen3-MoE (Qwen3's attention; sparse layers by
  `decoder_sparse_step` and `mlp_only_layers`, the others dense; top-k probabilities renormalised
  when `norm_topk_prob`) and Mixtral (Mistral's attention; every layer sparse, top-k
  renormalised). Both route the same way (a linear router, softmax in fp32, top-k), the layout
  most MoE checkpoints on the Hub share; models with shared experts or grouped routing
  (Qwen2-MoE, DeepSeek) are not served natively.

Every RoPE variant comes from transformers' own rotary module (rope_tables.py). `unsupported_reason`
names the first thing a config asks for that the decoder does not do; the engine then falls back
to transformers (model_runner.py), saying so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.inference.rope_tables import (
    DEFAULT_KIND,
    RopeFrequencies,
    layer_rope_kinds,
    length_limit,
    rope_frequencies,
    rope_types,
)
from asyncrl.inference.vision_tower import language_config


@dataclass(frozen=True)
class ArchFeatures:
    attention_bias: bool = False  # q/k/v projections have biases (Qwen2)
    qk_norm: bool = False  # RMSNorm of every query and key head before RoPE (Qwen3, Gemma 3)
    gemma: bool = False  # Gemma 3's norms, embedding scale, attention scale and activation
    moe: bool = False  # mixture-of-experts MLPs (MoeArgs.from_config reads the layout)
    # the transformers major version whose config and rotary module the decoder reads it by
    # (Gemma 3's per-layer-type RoPE parameters arrived in 5)
    min_transformers: int = 4


ARCHITECTURES: dict[str, ArchFeatures] = {
    "LlamaForCausalLM": ArchFeatures(),
    "MistralForCausalLM": ArchFeatures(),
    "Qwen2ForCausalLM": ArchFeatures(attention_bias=True),
    "Qwen3ForCausalLM": ArchFeatures(qk_norm=True),
    "Gemma3ForCausalLM": ArchFeatures(qk_norm=True, gemma=True, min_transformers=5),
    "Qwen3MoeForCausalLM": ArchFeatures(qk_norm=True, moe=True),
    "MixtralForCausalLM": ArchFeatures(moe=True),
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class MoeArgs:
    """A mixture-of-experts MLP: a linear router over `num_experts` experts, softmax in fp32, the
    `top_k` largest probabilities (renormalised to sum to 1 when `norm_topk_prob`) weight the
    chosen experts' SwiGLU outputs. `sparse[i]`: layer i has experts (else a dense MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    sparse: tuple[bool, ...]

    @classmethod
    def from_config(cls, config: Any, num_layers: int) -> MoeArgs:
        if config.model_type == "mixtral":  # every layer, always renormalised
            return cls(config.num_local_experts, config.num_experts_per_tok,
                       config.intermediate_size, True, (True,) * num_layers)
        step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or [])
        return cls(config.num_experts, config.num_experts_per_tok,
                   config.moe_intermediate_size, bool(config.norm_topk_prob),
                   tuple(config.num_experts > 0 and i not in dense and (i + 1) % step == 0
                         for i in range(num_layers)))

    @property
    def num_sparse(self) -> int:
        return sum(self.sparse)


@dataclass(frozen=True)
class DecoderArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: Mapping[str, RopeFrequencies]  # by rope kind (rope_tables.DEFAULT_KIND: one for all)
    layer_rope: tuple[str, ...]  # the rope kind of each layer
    windows: tuple[int, ...]  # each layer's sliding window (0: attends to the whole prefix)
    qk_norm: bool = False
    gemma: bool = False
    activation: str = "silu"  # silu or gelu_tanh
    attn_scale: float = 0.0  # query scaling; 0: head_dim ** -0.5
    embed_scale: float | None = None  # Gemma: sqrt(hidden), applied in the weights' dtype
    # a vision-language model's M-RoPE: rotary frequency dims per position stream (t, h, w)
    mrope_section: tuple[int, ...] | None = None
    # Qwen3-VL: the streams take turns over the frequency dims (t, h, w, t, h, w, ...) instead
    # of one section each
    mrope_interleaved: bool = False
    moe: MoeArgs | None = None  # mixture-of-experts layers; None: every MLP is dense

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def plain(self) -> bool:
        """A Llama/Qwen2 layer with one rope and no window: what the fused C++ decode step runs."""
        return (not (self.qk_norm or self.gemma or any(self.windows) or self.moe)
                and self.activation == "silu" and list(self.rope) == [DEFAULT_KIND]
                and self.attn_scale == 0.0)

    def num_parameters(self) -> int:
        """Weights the model holds (a tied lm_head once), as `PreTrainedModel.num_parameters`."""
        d, qkv = self.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        norms = (4 if self.gemma else 2) * d + (2 * self.head_dim if self.qk_norm else 0)
        layer = (
            norms
            + qkv * d + (qkv if self.attention_bias else 0)
            + d * self.num_heads * self.head_dim
        )
        mlps = 3 * self.intermediate_size * d * self.num_layers  # gate, up, down
        if self.moe is not None:  # a sparse layer: the router and every expert instead
            m = self.moe
            mlps += m.num_sparse * (m.num_experts * (d + 3 * m.intermediate_size * d)
                                    - 3 * self.intermediate_size * d)
        embeds = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + mlps + embeds + d

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], max_seq_len: int | None = None
                       ) -> DecoderArgs:
        """Raises ValueError naming the first feature this decoder does not implement (for
        sequences up to `max_seq_len`). A vision-language model's config gives its decoder's
        (vision_tower.language_config)."""
        reason = unsupported_reason(cfg, max_seq_len)
        if reason:
            raise ValueError(f"the built-in engine cannot run this checkpoint: {reason}")
        raw = language_config(cfg)
        config = hf_config_object(raw)
        features = features_of(raw)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = rope_frequencies(config) if not raw.get("mrope_section") else {
            DEFAULT_KIND: mrope_frequencies(config, head_dim)}
        num_layers = config.num_hidden_layers
        gemma = features.gemma
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            attention_bias=features.attention_bias or bool(getattr(config, "attention_bias",
                                                                   False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings",
                                             getattr(config, "tie_word_embeddings", False))),
            max_position_embeddings=config.max_position_embeddings,
            rope=rope,
            layer_rope=layer_rope_kinds(config, num_layers, list(rope)),
            windows=layer_windows(config, num_layers),
            qk_norm=features.qk_norm,
            gemma=gemma,
            activation=ACTIVATIONS[activation_name(config)],
            attn_scale=config.query_pre_attn_scalar ** -0.5 if gemma else 0.0,
            embed_scale=config.hidden_size ** 0.5 if gemma else None,
            mrope_section=tuple(raw["mrope_section"]) if raw.get("mrope_section") else None,
            mrope_interleaved=bool(raw.get("mrope_interleaved")),
            moe=MoeArgs.from_config(config, num_layers) if features.moe else None,
        )


def hf_config_object(raw: Mapping[str, Any]) -> Any:
    """transformers' config class for a config.json dict (its derived fields: layer_types, the
    normalised rope parameters)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items()
              if k not in ("model_type", "mrope_section", "mrope_interleaved")}
    return AutoConfig.for_model(raw["model_type"], **fields)


def features_of(raw: Mapping[str, Any]) -> ArchFeatures:
    return next(ARCHITECTURES[a] for a in raw.get("architectures") or [] if a in ARCHITECTURES)


def activation_name(config: Any) -> str:
    return (getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
            or "silu")


def layer_windows(config: Any, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window: the `sliding_attention` layers of `layer_types`, or every
    layer of a model with a window and no layer types (Mistral)."""
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if types is None:
        return (window,) * num_layers
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def mrope_frequencies(config: Any, head_dim: int) -> RopeFrequencies:
    """M-RoPE rotates each section with the default frequencies of rope_theta."""
    import torch

    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv = 1.0 / theta ** (steps / head_dim)
    return RopeFrequencies(inv, 1.0)


def unsupported_reason(cfg: Mapping[str, Any], max_seq_len: int | None = None) -> str | None:
    """Why the compact decoder cannot reproduce this HF config exactly for sequences up to
    `max_seq_len` (None: the model's max_position_embeddings); None if it can."""
    raw = language_config(cfg)  # a vision-language model: its decoder's
    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        return f"architectures={archs}; supported {sorted(ARCHITECTURES)}"
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major < features_of(raw).min_transformers:
        return (f"the native decoder reads {archs[0]} with transformers >= "
                f"{features_of(raw).min_transformers}; this is {transformers.__version__}")
    try:
        config = hf_config_object(raw)
    except (ValueError, KeyError, TypeError) as err:
        return f"transformers cannot read its config ({err})"
    act = activation_name(config)
    if act not in ACTIVATIONS:
        return f"hidden_act={act!r}; supported {sorted(ACTIVATIONS)}"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias=True; supported False"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            return f"{name}={getattr(config, name)}; supported None"
    if raw.get("mrope_section"):
        return None  # Qwen2-VL's decoder: M-RoPE over the default frequencies
    limit, longest = length_limit(config), max_seq_len or config.max_position_embeddings
    if limit is not None and longest > limit:
        return (f"its RoPE ({', '.join(sorted(rope_types(config)))}) rotates a sequence longer "
                f"than {limit} tokens differently once it is that long, which a KV cache cannot "
                f"follow; max_seq_len={longest} (set inference.engine.max_seq_len <= {limit} to "
                "serve it natively)")
    try:
        rope = rope_frequencies(config)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"its rotary embedding cannot be built ({type(err).__name__}: {err})"
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if any(2 * f.inv_freq.numel() != head_dim for f in rope.values()):
        return "partial rotary embeddings (rotating part of each head); supported: whole heads"
    return None

