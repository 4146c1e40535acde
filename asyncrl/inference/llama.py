"""A compact Llama / Qwen2 decoder that reads and writes the engine's preallocated KV cache.

Weights load by their Hugging Face names straight from safetensors (no transformers model object):
q/k/v projections are fused into one matrix and gate/up into another, so a decode step over the
whole batch is five matmuls per layer. Two forward entry points share the layer code and differ
only in attention:

- `prefill`: right-padded `[n, L]` prompts computed from position 0, K/V written into the
  sequences' slots (causal attention over the fresh K/V; right padding never leaks into real
  tokens under a causal mask).
- `decode`: one new token per sequence at its own position; sequence i lives in cache slot i (the
  scheduler keeps the running set compact).

On CPU the C++ kernels (`kernels.py`, built on first use) do RoPE, the cache write and attention
over each row's own positions in one pass, and RMSNorm; in fp32 with `KernelMatmuls` a whole decode
step is a single C++ call. Without them (no compiler, `cpu_kernels=False`, CUDA) the torch path
runs: SDPA for prefill, and for decode a batched matmul over `cache[:n, :, :T]` as a view with
positions past each sequence's length masked. Every tensor the model allocates names its device
(the one passed in, or its inputs'), so the same code runs on CPU and CUDA.

The cache layout is `[num_layers, 2 (k/v), num_slots, num_kv_heads, max_seq_len, head_dim]`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.inference import kernels
from asyncrl.inference.vision_tower import language_config
from asyncrl.inference.linear import (
    KernelMatmuls,
    Matmuls,
    PlainMatmuls,
    make_fast_matmuls,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool  # Qwen2: q/k/v projections have biases
    tie_word_embeddings: bool
    max_position_embeddings: int
    # a vision-language model's M-RoPE: rotary frequency dims per position stream (t, h, w)
    mrope_section: tuple[int, ...] | None = None

    def num_parameters(self) -> int:
        """Weights the model holds (a tied lm_head once), as `PreTrainedModel.num_parameters`."""
        d, qkv = self.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        layer = (
            2 * d  # the two norms
            + qkv * d + (qkv if self.attention_bias else 0)
            + d * self.num_heads * self.head_dim
            + 3 * self.intermediate_size * d  # gate, up, down
        )
        embeds = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeds + d

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> LlamaArgs:
        """Raises ValueError naming the first feature this compact model does not implement.
        A vision-language model's config gives its decoder's (vision_tower.language_config)."""
        reason = unsupported_reason(cfg)
        if reason:
            raise ValueError(f"compact model cannot run this checkpoint: {reason}")
        cfg = language_config(cfg)
        rope = cfg.get("rope_parameters") or {}
        heads = cfg["num_attention_heads"]
        is_qwen2 = cfg.get("model_type") == "qwen2"
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            attention_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg["max_position_embeddings"],
            mrope_section=tuple(cfg["mrope_section"]) if cfg.get("mrope_section") else None,
        )


def unsupported_reason(cfg: Mapping[str, Any]) -> str | None:
    """Why the compact model cannot reproduce this HF config exactly (None if it can)."""
    cfg = language_config(cfg)  # a vision-language model: its decoder's
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return f"architectures={archs}; supported {list(SUPPORTED_ARCHITECTURES)}"
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope_type={rope.get('rope_type', rope.get('type'))!r}; supported 'default'"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"hidden_act={cfg.get('hidden_act')!r}; supported 'silu'"
    if cfg.get("mlp_bias"):
        return "mlp_bias=True; supported False"
    if cfg.get("use_sliding_window"):
        return "use_sliding_window=True; supported False"
    return None


def check_device(device: torch.device, tensors: Iterable[torch.Tensor]) -> None:
    """RuntimeError for a tensor not on `device` (an allocation that did not name its device)."""
    for t in tensors:
        if t.device.type != device.type or device.index not in (None, t.device.index):
            raise RuntimeError(f"a {tuple(t.shape)} tensor is on {t.device}, expected {device}")


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv_w: torch.Tensor  # [(H + 2K) * hd, D]: q, k, v stacked
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    ln2: torch.Tensor
    gate_up_w: torch.Tensor  # [2 * I, D]: gate, up stacked
    down_w: torch.Tensor


@dataclass
class _Ctx:
    """Per-step tensors shared by every layer."""

    cache: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    n: int
    length: int  # prefill: padded prompt length; decode: attended length T
    slots: torch.Tensor | None = None  # prefill: slot per prompt (kernels: per row)
    positions: torch.Tensor | None = None  # kernels: position of each row's token
    kv_rows: torch.Tensor | None = None  # decode, torch path: rows of the flat layer cache
    mask: torch.Tensor | None = None  # decode, torch path: additive [n * K, 1, T]


class LlamaModel:
    def __init__(
        self, args: LlamaArgs, dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu", rows_hint: int = 64, fast_matmuls: bool = True,
        cpu_kernels: bool = True,
    ) -> None:
        self.args, self.dtype, self.device = args, dtype, torch.device(device)
        on_cpu = self.device.type == "cpu"
        # The C++ kernels and the prepacked matmuls read host memory: CPU only.
        self.rows_hint, self.use_fast = rows_hint, fast_matmuls and on_cpu
        a = args
        d, hd, inter = a.hidden_size, a.head_dim, a.intermediate_size
        self.q_dim, self.kv_dim = a.num_heads * hd, a.num_kv_heads * hd

        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        self.embed = empty(a.vocab_size, d)
        self.lm_head = self.embed if a.tie_word_embeddings else empty(a.vocab_size, d)
        self.norm = empty(d)
        self.layers = [
            _Layer(
                ln1=empty(d),
                qkv_w=empty(self.q_dim + 2 * self.kv_dim, d),
                qkv_b=empty(self.q_dim + 2 * self.kv_dim) if a.attention_bias else None,
                o_w=empty(d, self.q_dim),
                ln2=empty(d),
                gate_up_w=empty(2 * inter, d),
                down_w=empty(d, inter),
            )
            for _ in range(a.num_layers)
        ]
        # HF computes RoPE in fp32; rotate_half(x) * sin == roll(x, hd/2) * [-sin, sin]. Built on
        # the host (the same table on every device), then moved.
        cpu = torch.device("cpu")
        self.inv_freq = 1.0 / a.rope_theta ** (
            torch.arange(0, hd, 2, dtype=torch.float32, device=cpu) / hd)
        # M-RoPE decodes at cache position + a (negative) rope delta: the kernels' tables start
        # `margin` positions before 0, so a shifted view of them is still inside the table.
        self.margin = a.max_position_embeddings if a.mrope_section else 0
        pos = torch.arange(-self.margin, a.max_position_embeddings, dtype=torch.float32,
                           device=cpu)
        cos, sin = self._rope_rows(pos[:, None] * self.inv_freq)
        self.cos, self.sin = cos[self.margin:].to(self.device), sin[self.margin:].to(self.device)
        if a.mrope_section:  # which position stream rotates each frequency dim
            self.mrope_stream = torch.repeat_interleave(
                torch.arange(3), torch.tensor(a.mrope_section)).to(self.device)
            self.inv_freq = self.inv_freq.to(self.device)
        self._kernels = self._load_kernels() if cpu_kernels and on_cpu else None
        # The kernels read fp32 tables holding the values the torch path uses (rounded to dtype).
        self.cos32 = self.sin32 = None
        if self._kernels is not None:
            self._cos32_all, self._sin32_all = cos.float(), sin.float()
            self.cos32, self.sin32 = self._kernel_rope(0)
        self._dims: tuple[tuple[int, ...], kernels.ModelDims] | None = None  # per cache shape
        self._targets = self._name_map()
        check_device(self.device, [*self._targets.values(), self.cos, self.sin])
        self._plain = PlainMatmuls(self.layers, self.lm_head)
        self._fast: Matmuls | None = None  # built from real weights in load_weights

    def _rope_rows(self, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sign-folded sin) rows in this model's dtype from fp32 freqs [..., hd / 2]."""
        cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(self.dtype)
        return cos, torch.cat([-freqs.sin(), freqs.sin()], -1).to(self.dtype)

    def _kernel_rope(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' fp32 tables viewed so that row p holds position p + offset."""
        if not -self.margin <= offset < self.args.max_position_embeddings:
            raise ValueError(f"rope offset {offset} is out of range; allowed "
                             f"[{-self.margin}, {self.args.max_position_embeddings})")
        start = self.margin + offset
        return self._cos32_all[start:], self._sin32_all[start:]

    def mrope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [n, L, 1, hd] of M-RoPE positions [3 (t, h, w), n, L]: frequency dim j
        rotates by the position of stream mrope_stream[j] (transformers' Qwen2-VL layout)."""
        picked = positions.to(self.device)[self.mrope_stream]  # [hd / 2, n, L]
        cos, sin = self._rope_rows(picked.permute(1, 2, 0).float() * self.inv_freq)
        return cos[:, :, None], sin[:, :, None]

    def _load_kernels(self) -> kernels.CpuKernels | None:
        if not kernels.CpuKernels.supports(self.dtype, self.args.head_dim, self.device):
            return None
        lib = kernels.load()
        return kernels.CpuKernels(lib, self.dtype) if lib is not None else None

    def _name_map(self) -> dict[str, torch.Tensor]:
        """HF parameter name -> the (view of the) tensor it is copied into."""
        q, kv, inter = self.q_dim, self.kv_dim, self.args.intermediate_size
        m = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not self.args.tie_word_embeddings:
            m["lm_head.weight"] = self.lm_head
        for i, w in enumerate(self.layers):
            p = f"model.layers.{i}."
            m[p + "input_layernorm.weight"] = w.ln1
            m[p + "post_attention_layernorm.weight"] = w.ln2
            parts = (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, None)))
            for name, sl in parts:
                m[p + f"self_attn.{name}_proj.weight"] = w.qkv_w[sl]
                if w.qkv_b is not None:
                    m[p + f"self_attn.{name}_proj.bias"] = w.qkv_b[sl]
            m[p + "self_attn.o_proj.weight"] = w.o_w
            m[p + "mlp.gate_proj.weight"] = w.gate_up_w[:inter]
            m[p + "mlp.up_proj.weight"] = w.gate_up_w[inter:]
            m[p + "mlp.down_proj.weight"] = w.down_w
        return m

    @torch.inference_mode()
    def load_weights(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        strict: bool = True,
    ) -> None:
        """Copy HF-named tensors in place (no reallocation; views stay valid), from any device
        and dtype into this model's.

        `strict` requires every parameter; a partial update (one bucket of a stream) passes False.
        Names and shapes are all checked before the first copy, so a bad update leaves the old
        weights intact.
        """
        items = weights.items() if isinstance(weights, Mapping) else weights
        pairs, seen = [], set()
        for name, tensor in items:
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                name = "model.embed_tokens.weight"  # some exporters write the tied copy too
            target = self._targets.get(name)
            if target is None:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # a derived buffer some checkpoints carry
                raise ValueError(f"unknown weight {name!r} for {self.args.num_layers}-layer model")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}; "
                    f"expected {tuple(target.shape)}"
                )
            pairs.append((target, tensor))
            seen.add(name)
        missing = sorted(set(self._targets) - seen)
        if strict and missing:
            raise ValueError(f"{len(missing)} weights missing from the update, e.g. {missing[:3]}")
        for target, tensor in pairs:
            target.copy_(tensor)
        if self._fast is not None:
            self._fast.repack()
        elif self.use_fast and not missing:
            self._fast = make_fast_matmuls(
                self.layers, self.lm_head, self.rows_hint, self._kernels
            )

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed)

    def _rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return torch.addcmul(x * cos, x.roll(self.args.head_dim // 2, -1), sin, out=out)

    def _attn_prefill(self, layer: int, qkv: torch.Tensor, c: _Ctx) -> torch.Tensor:
        a, n, length = self.args, c.n, c.length
        h, kvh, hd = a.num_heads, a.num_kv_heads, a.head_dim
        qk = qkv[:, : self.q_dim + self.kv_dim].view(n, length, h + kvh, hd)
        qk = self._rope(qk, c.cos, c.sin)
        q = qk[:, :, :h].transpose(1, 2)
        k = qk[:, :, h:].transpose(1, 2)
        v = qkv[:, self.q_dim + self.kv_dim:].view(n, length, kvh, hd).transpose(1, 2)
        c.cache[layer, 0][c.slots, :, :length] = k
        c.cache[layer, 1][c.slots, :, :length] = v
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kvh != h)
        return o.transpose(1, 2).reshape(n * length, self.q_dim)

    def _attn_kernel(self, layer: int, qkv: torch.Tensor, c: _Ctx) -> torch.Tensor:
        """Prefill and decode alike: row r attends to positions [0, c.positions[r]] of its slot."""
        return self._kernels.attention(
            qkv, c.cache[layer, 0], c.cache[layer, 1], c.cos, c.sin, c.slots,
            c.positions, self.args.num_heads,
        )

    def _attn_decode(self, layer: int, qkv: torch.Tensor, c: _Ctx) -> torch.Tensor:
        a, n, t = self.args, c.n, c.length
        h, kvh, hd = a.num_heads, a.num_kv_heads, a.head_dim
        qk = qkv[:, : self.q_dim + self.kv_dim].view(n, h + kvh, hd)
        # RoPE in place, so the new k and v are adjacent in each row and reach the cache in one
        # index_copy_ (flat cache rows precomputed per step in `decode`).
        self._rope(qk, c.cos, c.sin, out=qk)
        flat = c.cache[layer].view(-1, hd)
        flat.index_copy_(0, c.kv_rows, qkv[:, self.q_dim:].reshape(n * 2 * kvh, hd))
        # GQA without repeating K/V: the h // kvh query heads sharing a kv head form one bmm row
        # block, and (slot, kv head) merge into the batch dim of a view of the cache.
        k = c.cache[layer, 0, :n, :, :t].reshape(n * kvh, t, hd)
        v = c.cache[layer, 1, :n, :, :t].reshape(n * kvh, t, hd)
        q = qkv[:, : self.q_dim].reshape(n * kvh, h // kvh, hd)
        scores = torch.baddbmm(c.mask, q, k.transpose(1, 2), alpha=hd**-0.5)
        return torch.bmm(scores.softmax(-1), v).view(n, self.q_dim)

    def _layers(
        self, x: torch.Tensor, attn, c: _Ctx, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`keep`: rows whose output is wanted. The last layer runs its attention output, o_proj
        and MLP on those rows only (every row's K/V is already cached by then); for a prefill
        that skips about a tenth of the FLOPs."""
        mm = self._matmuls(x.shape[0])
        last = len(self.layers) - 1
        for i, w in enumerate(self.layers):
            a = attn(i, mm.qkv(i, self._norm(x, w.ln1)), c)
            if keep is not None and i == last:
                a, x = a[keep], x[keep]
            x = mm.o_proj_add(i, a, x)
            x = mm.mlp_add(i, self._norm(x, w.ln2), x)
        return x

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # torch's CPU rms_norm is about eight ops; the kernel is one pass (same fp32 statistics).
        if self._kernels is not None and x.is_contiguous():
            return self._kernels.rms_norm(x, w, self.args.rms_norm_eps)
        return F.rms_norm(x, (self.args.hidden_size,), w, self.args.rms_norm_eps)

    def _model_dims(self, cache: torch.Tensor, offset: int = 0) -> kernels.ModelDims:
        a, (layers, _, _, kvh, max_len, hd) = self.args, cache.shape
        key = (*cache.shape, offset)
        if self._dims is None or self._dims[0] != key:
            cos, sin = self._kernel_rope(offset)
            dims = kernels.ModelDims(
                layers, a.hidden_size, self.q_dim + 2 * self.kv_dim, a.intermediate_size,
                a.num_heads, kvh, hd, max_len, cache.stride(0), cache.stride(1), a.rms_norm_eps,
                cos.data_ptr(), sin.data_ptr(),
            )
            self._dims = (key, dims)
        return self._dims[1]

    def _use_kernels(self, cache: torch.Tensor, *inputs: torch.Tensor) -> bool:
        if self._kernels is None:
            return False
        # The C side trusts its pointers: a tensor elsewhere would be read as host memory.
        check_device(torch.device("cpu"), [cache, *inputs])
        return cache.is_contiguous() and cache.dtype == self.dtype

    def _matmuls(self, rows: int) -> Matmuls:
        fast = self._fast
        return fast if fast is not None and rows >= fast.MIN_ROWS else self._plain

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmuls(x.shape[0]).logits(self._norm(x, self.norm)).float()

    @torch.inference_mode()
    def prefill(
        self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
        embeds: torch.Tensor | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """tokens [n, L] right-padded, lengths [n], slots [n] -> fp32 logits of each last token.

        A multimodal prompt passes its input embeddings [n * L, D] (images filled in) and its
        M-RoPE rows (`mrope_rows`); it runs the torch attention path."""
        n, length = tokens.shape
        x = F.embedding(tokens.reshape(-1), self.embed) if embeds is None else embeds
        last = torch.arange(n, device=tokens.device) * length + lengths - 1
        if rope is not None:
            c = _Ctx(cache, rope[0], rope[1], n, length, slots=slots)
            return self._logits(self._layers(x, self._attn_prefill, c, last))
        if self._use_kernels(cache, tokens, lengths, slots):
            # Padding rows write K/V past their prompt's end: harmless, since decode overwrites
            # a position before any query reads it.
            c = _Ctx(
                cache, self.cos32, self.sin32, n * length, length,
                slots=slots.long().repeat_interleave(length),
                positions=torch.arange(length, device=tokens.device).repeat(n),
            )
            check_device(tokens.device, [c.slots, c.positions])  # read by the C side
            return self._logits(self._layers(x, self._attn_kernel, c, last))
        cos = self.cos[:length, None]  # [L, 1, hd], broadcast over rows and heads
        sin = self.sin[:length, None]
        c = _Ctx(cache, cos, sin, n, length, slots=slots)
        return self._logits(self._layers(x, self._attn_prefill, c, last))

    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
        attend: int | None = None, rope_offset: int | torch.Tensor = 0,
    ) -> torch.Tensor:
        """tokens [n] at positions [n]; row i is cache slot i -> fp32 logits [n, V].

        `attend`: max(positions) + 1 when the caller knows it (reading it from a CUDA tensor
        would stall the host until the device catches up). `rope_offset`: M-RoPE's delta, added
        to each position for the rotation only (one int for every row, as the kernels take it,
        or one per row [n])."""
        n = tokens.shape[0]
        x = F.embedding(tokens, self.embed)
        per_row = isinstance(rope_offset, torch.Tensor)
        if not per_row and self._use_kernels(cache, tokens, positions):
            positions = positions.long().contiguous()
            if isinstance(self._fast, KernelMatmuls):
                # One C++ call for the whole step: the kernels below without per-op overhead.
                return self._fast.forward(x, self.norm, cache, positions,
                                          self._model_dims(cache, rope_offset))
            cos, sin = self._kernel_rope(rope_offset)
            c = _Ctx(cache, cos, sin, n, 0, positions=positions)
            return self._logits(self._layers(x, self._attn_kernel, c))
        ctx = self._decode_ctx(cache, positions, attend, positions + rope_offset)
        return self._logits(self._layers(x, self._attn_decode, ctx))

    def _decode_ctx(
        self, cache: torch.Tensor, positions: torch.Tensor, attend: int | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> _Ctx:
        """The mask and cache rows of the torch attention path."""
        n, dev = positions.shape[0], positions.device
        t = int(positions.max()) + 1 if attend is None else attend
        _, _, slots, kvh, max_len, _ = cache.shape
        masked = torch.arange(t, device=dev) > positions[:, None]  # [n, T]: past each new token
        mask = torch.zeros(n, 1, t, dtype=self.dtype, device=dev)
        mask.masked_fill_(masked[:, None], float("-inf"))
        # Row of cache[layer].view(-1, head_dim) for (sequence i, k/v, kv head): matches the
        # order of qkv[:, q_dim:] viewed as [n, 2, kvh, head_dim].
        kv = torch.arange(2, device=dev)[None, :, None]
        head = torch.arange(kvh, device=dev)[None, None, :]
        i = torch.arange(n, device=dev)[:, None, None]
        kv_rows = ((kv * slots + i) * kvh + head) * max_len + positions[:, None, None]
        rot = positions if rope_positions is None else rope_positions
        return _Ctx(
            cache, self.cos[rot, None], self.sin[rot, None], n, t,
            kv_rows=kv_rows.reshape(-1), mask=mask.repeat_interleave(kvh, 0),
        )
