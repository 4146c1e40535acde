"""The compact decoder: Llama, Mistral, Qwen2/3, Gemma 3, Qwen3-MoE and Mixtral layers reading and
writing the engine's preallocated KV cache.

Weights load by their Hugging Face names straight from safetensors (no transformers model object):
q/k/v projections are fused into one matrix and gate/up into another, so a decode step over the
whole batch is five matmuls per layer. What differs between architectures (decoder_args.py) is a
few switches in one layer loop: q/k head norms, Gemma's (1 + w) norms around the attention and
the MLP, the embedding and query scales, the MLP's activation, each layer's sliding window and
RoPE table (rope_tables.py: transformers' own frequencies, every scaling it ships). Two forward
entry points share the layer code and differ only in attention:

- `prefill`: right-padded `[n, L]` prompts computed from position 0, K/V written into the
  sequences' slots (causal attention over the fresh K/V; right padding never leaks into real
  tokens under a causal mask).
- `decode`: one new token per sequence at its own position; sequence i lives in cache slot i (the
  scheduler keeps the running set compact).

On CPU the C++ kernels (`kernels.py`, built on first use) do RoPE, the cache write and attention
over each row's own positions (its window's) in one pass, and RMSNorm; in fp32 with
`KernelMatmuls` a whole decode step of a plain Llama/Qwen2 is a single C++ call. Without them (no
compiler, `cpu_kernels=False`, CUDA) the torch path runs: SDPA for prefill, and for decode a
batched matmul over `cache[:n, :, :T]` as a view with positions past each sequence's length (or
before its window) masked. Every tensor the model allocates names its device (the one passed in,
or its inputs'), so the same code runs on CPU and CUDA.

A mixture-of-experts layer routes each row to its top-k experts and runs each expert once over
the rows that chose it (moe.py); `routes` collects the experts every sparse layer chose for every
row. Its expert weights are stored `[experts, ...]` as transformers 5 holds them
and load from either spelling (`weight_names.expert_weights`).

The cache layout is `[num_layers, 2 (k/v), num_slots, num_kv_heads, max_seq_len, head_dim]`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncrl.inference import kernels
from asyncrl.inference.decoder_args import DecoderArgs
from asyncrl.inference.decoder_weights import Layer, empty_layers, hf_names
from asyncrl.inference.linear import (
    KernelMatmuls,
    Matmuls,
    PlainMatmuls,
    make_fast_matmuls,
)
from asyncrl.inference.moe import route, run_experts
from asyncrl.inference.rope_tables import DEFAULT_KIND, cos_sin
from asyncrl.models.weight_names import expert_weights


def check_device(device: torch.device, tensors: Iterable[torch.Tensor]) -> None:
    """RuntimeError for a tensor not on `device` (an allocation that did not name its device)."""
    for t in tensors:
        if t.device.type != device.type or device.index not in (None, t.device.index):
            raise RuntimeError(f"a {tuple(t.shape)} tensor is on {t.device}, expected {device}")


def mrope_streams(section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """The position stream (0 time, 1 height, 2 width) of each rotary frequency dim: one section
    each (Qwen2-VL), or taking turns t, h, w, t, h, w, ... while each stream's section lasts, the
    rest time (Qwen3-VL)."""
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    streams = torch.zeros(sum(section), dtype=torch.long)
    for stream in (1, 2):
        streams[stream:3 * section[stream]:3] = stream
    return streams


@dataclass
class _Ctx:
    """Per-step tensors shared by every layer."""

    cache: torch.Tensor
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) by rope kind
    n: int
    length: int  # prefill: padded prompt length; decode: attended length T
    slots: torch.Tensor | None = None  # prefill: slot per prompt (kernels: per row)
    positions: torch.Tensor | None = None  # kernels: position of each row's token
    kv_rows: torch.Tensor | None = None  # decode, torch path: rows of the flat layer cache
    masks: dict[int, torch.Tensor] | None = None  # torch path: by window (0: none), additive
    routes: list[torch.Tensor] | None = None  # collects each sparse layer's [rows, k] experts
    # Qwen3-VL's DeepStack: what the first len(deepstack) layers' outputs add ([rows, D], zero
    # off the image tokens)
    deepstack: list[torch.Tensor] | None = None


class DecoderModel:
    def __init__(
        self, args: DecoderArgs, dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu", rows_hint: int = 64, fast_matmuls: bool = True,
        cpu_kernels: bool = True, max_seq_len: int | None = None, record_routes: bool = False,
    ) -> None:
        """`record_routes`: each forward leaves the experts its sparse layers chose for every
        row in `last_routes` ([rows, sparse layers, top_k], rows as the forward's input; rollout
        routing replay)."""
        self.args, self.dtype, self.device = args, dtype, torch.device(device)
        on_cpu = self.device.type == "cpu"
        # The C++ kernels and the prepacked matmuls read host memory: CPU only.
        # (the prepacked layouts are per dense MLP: a mixture-of-experts model runs plain matmuls)
        self.rows_hint, self.use_fast = rows_hint, fast_matmuls and on_cpu and args.moe is None
        a = args
        d, hd = a.hidden_size, a.head_dim
        self.q_dim, self.kv_dim = a.num_heads * hd, a.num_kv_heads * hd

        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        self.embed = empty(a.vocab_size, d)
        self.lm_head = self.embed if a.tie_word_embeddings else empty(a.vocab_size, d)
        self.norm = empty(d)
        self.layers = empty_layers(a, empty)
        # Gemma scales the embeddings by sqrt(hidden) rounded to the weights' dtype
        self.embed_scale = (None if a.embed_scale is None
                            else torch.tensor(a.embed_scale, dtype=dtype, device=self.device))
        # RoPE tables as transformers' forward computes them (rope_tables.py), built on the host
        # (the same table on every device), then moved. M-RoPE decodes at cache position + a
        # (negative) rope delta: the kernels' tables start `margin` positions before 0, so a
        # shifted view of them is still inside the table.
        cpu = torch.device("cpu")
        length = min(a.max_position_embeddings, max_seq_len or a.max_position_embeddings)
        self.rope_len, self.margin = length, length if a.mrope_section else 0
        pos = torch.arange(-self.margin, length, device=cpu)
        tables = {kind: cos_sin(f, pos, hd, dtype) for kind, f in a.rope.items()}
        self.rope = {kind: (c[self.margin:].to(self.device), s_[self.margin:].to(self.device))
                     for kind, (c, s_) in tables.items()}
        if a.mrope_section:  # which position stream rotates each frequency dim
            self.mrope_stream = mrope_streams(a.mrope_section, a.mrope_interleaved).to(
                self.device)
            self.inv_freq = a.rope[DEFAULT_KIND].inv_freq.to(self.device)
        self._kernels = self._load_kernels() if cpu_kernels and on_cpu else None
        # The kernels read fp32 tables holding the values the torch path uses (rounded to dtype).
        self._rope32_all = {kind: (c.float(), s_.float()) for kind, (c, s_) in tables.items()}
        self.rope32 = self._kernel_rope(0) if self._kernels is not None else None
        self._dims: tuple[tuple[int, ...], kernels.ModelDims] | None = None  # per cache shape
        self._targets = hf_names(self.layers, self.embed, self.lm_head, self.norm, args)
        check_device(self.device, [*self._targets.values(),
                                   *(t for pair in self.rope.values() for t in pair)])
        self._plain = PlainMatmuls(self.layers, self.lm_head, a.activation)
        self.record_routes = record_routes and args.moe is not None
        self.last_routes: torch.Tensor | None = None
        self._fast: Matmuls | None = None  # built from real weights in load_weights
        # Gemma's norms multiply by (1 + w): kept next to each weight as one fp32 tensor (so a
        # norm is one rms_norm call, the C++ kernel's on CPU), refreshed in place after every
        # weight update
        self._plus_one: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if a.gemma:
            norms = [self.norm, *(t for w in self.layers for t in (
                w.ln1, w.ln2, w.post_attn, w.post_mlp, w.q_norm, w.k_norm) if t is not None)]
            self._plus_one = {id(t): (t, torch.ones(t.shape, device=self.device))
                              for t in norms}

    def _rope_rows(self, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sign-folded sin) rows in this model's dtype from fp32 freqs [..., hd / 2]."""
        cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(self.dtype)
        return cos, torch.cat([-freqs.sin(), freqs.sin()], -1).to(self.dtype)

    def _kernel_rope(self, offset: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The kernels' fp32 tables viewed so that row p holds position p + offset."""
        if not -self.margin <= offset < self.rope_len:
            raise ValueError(f"rope offset {offset} is out of range; allowed "
                             f"[{-self.margin}, {self.rope_len})")
        start = self.margin + offset
        return {kind: (c[start:], s_[start:]) for kind, (c, s_) in self._rope32_all.items()}

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
        if self.args.moe is not None:
            items = expert_weights(items, self.args.moe.intermediate_size)
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
        for weight, plus_one in self._plus_one.values():
            torch.add(weight.float(), 1.0, out=plus_one)
        if self._fast is not None:
            self._fast.repack()
        elif self.use_fast and not missing:
            self._fast = make_fast_matmuls(
                self.layers, self.lm_head, self.rows_hint, self._kernels, self.args.activation
            )

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embed)
        return x if self.embed_scale is None else x * self.embed_scale

    def _rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return torch.addcmul(x * cos, x.roll(self.args.head_dim // 2, -1), sin, out=out)

    def _qk_norm(self, layer: Layer, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3 / Gemma 3: RMSNorm over each query and each key head (before RoPE)."""
        a, rows = self.args, qkv.shape[0]
        q = self._norm(qkv[:, :self.q_dim].reshape(rows * a.num_heads, a.head_dim), layer.q_norm)
        k = self._norm(qkv[:, self.q_dim:self.q_dim + self.kv_dim]
                       .reshape(rows * a.num_kv_heads, a.head_dim), layer.k_norm)
        return torch.cat([q.view(rows, self.q_dim), k.view(rows, self.kv_dim),
                          qkv[:, self.q_dim + self.kv_dim:]], -1)

    def _attn_prefill(self, layer: int, qkv: torch.Tensor, c: _Ctx) -> torch.Tensor:
        a, n, length = self.args, c.n, c.length
        h, kvh, hd = a.num_heads, a.num_kv_heads, a.head_dim
        cos, sin = c.rope[a.layer_rope[layer]]
        qk = qkv[:, : self.q_dim + self.kv_dim].view(n, length, h + kvh, hd)
        qk = self._rope(qk, cos, sin)
        q = qk[:, :, :h].transpose(1, 2)
        k = qk[:, :, h:].transpose(1, 2)
        v = qkv[:, self.q_dim + self.kv_dim:].view(n, length, kvh, hd).transpose(1, 2)
        c.cache[layer, 0][c.slots, :, :length] = k
        c.cache[layer, 1][c.slots, :, :length] = v
        window = a.windows[layer]
        mask = None if not window or window >= length else self._window_mask(length, window, q)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=kvh != h, scale=a.scale)
        return o.transpose(1, 2).reshape(n * length, self.q_dim)

    @staticmethod
    def _window_mask(length: int, window: int, like: torch.Tensor) -> torch.Tensor:
        """Causal and within the window: query i sees keys j with i - window < j <= i."""
        i = torch.arange(length, device=like.device)
        return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)

    def _attn_kernel(self, layer: int, qkv: torch.Tensor, c: _Ctx) -> torch.Tensor:
        """Prefill and decode alike: row r attends to positions [0, c.positions[r]] of its slot
        (the last `window` of them in a sliding-window layer)."""
        a = self.args
        cos, sin = c.rope[a.layer_rope[layer]]
        return self._kernels.attention(
            qkv, c.cache[layer, 0], c.cache[layer, 1], cos, sin, c.slots,
            c.positions, a.num_heads, a.scale, a.windows[layer],
        )

    def _attn_decode(self, layer: int, qkv: torch.Tensor, c: _Ctx) -> torch.Tensor:
        a, n, t = self.args, c.n, c.length
        h, kvh, hd = a.num_heads, a.num_kv_heads, a.head_dim
        cos, sin = c.rope[a.layer_rope[layer]]
        qk = qkv[:, : self.q_dim + self.kv_dim].view(n, h + kvh, hd)
        # RoPE in place, so the new k and v are adjacent in each row and reach the cache in one
        # index_copy_ (flat cache rows precomputed per step in `decode`).
        self._rope(qk, cos, sin, out=qk)
        flat = c.cache[layer].view(-1, hd)
        flat.index_copy_(0, c.kv_rows, qkv[:, self.q_dim:].reshape(n * 2 * kvh, hd))
        # GQA without repeating K/V: the h // kvh query heads sharing a kv head form one bmm row
        # block, and (slot, kv head) merge into the batch dim of a view of the cache.
        k = c.cache[layer, 0, :n, :, :t].reshape(n * kvh, t, hd)
        v = c.cache[layer, 1, :n, :, :t].reshape(n * kvh, t, hd)
        q = qkv[:, : self.q_dim].reshape(n * kvh, h // kvh, hd)
        scores = torch.baddbmm(c.masks[a.windows[layer]], q, k.transpose(1, 2), alpha=a.scale)
        return torch.bmm(scores.softmax(-1), v).view(n, self.q_dim)

    def _layers(
        self, x: torch.Tensor, attn, c: _Ctx, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`keep`: rows whose output is wanted. The last layer runs its attention output, o_proj
        and MLP on those rows only (every row's K/V is already cached by then); for a prefill
        that skips about a tenth of the FLOPs."""
        mm = self._matmuls(x.shape[0])
        deep = c.deepstack or []
        # recording routes, or a DeepStack feature for the last layer: it runs every row too
        last = len(self.layers) - 1 if c.routes is None and len(deep) < len(self.layers) else -1
        for i, w in enumerate(self.layers):
            qkv = mm.qkv(i, self._norm(x, w.ln1))
            if w.q_norm is not None:
                qkv = self._qk_norm(w, qkv)
            a = attn(i, qkv, c)
            if keep is not None and i == last:
                a, x = a[keep], x[keep]
            if w.router_w is not None:
                x = mm.o_proj_add(i, a, x)
                x = self._moe(w, self._norm(x, w.ln2), c) + x
            elif w.post_attn is None:
                x = mm.o_proj_add(i, a, x)
                x = mm.mlp_add(i, self._norm(x, w.ln2), x)
            else:  # Gemma: each block's output is normed before it joins the residual
                x = x + self._norm(mm.o_proj_add(i, a, None), w.post_attn)
                x = x + self._norm(mm.mlp_add(i, self._norm(x, w.ln2), None), w.post_mlp)
            if i < len(deep):
                x = x + deep[i]
        if c.routes is not None:
            self.last_routes = torch.stack(c.routes, 1) if c.routes else None
        if keep is not None and last == -1:
            x = x[keep]
        return x

    def _moe(self, w: Layer, h: torch.Tensor, c: _Ctx) -> torch.Tensor:
        """A sparse layer's MLP on rows h (moe.py), its routes collected when recorded."""
        top_w, top_i = route(self.args.moe, w.router_w, h)
        if c.routes is not None:
            c.routes.append(top_i)
        return run_experts(self.args.moe, w.experts_gate_up, w.experts_down, h, top_w, top_i,
                           self._plain.act)

    def _routes(self) -> list[torch.Tensor] | None:
        """A list for the step's routes when they are recorded (`record_routes`)."""
        return [] if self.record_routes else None

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        eps = self.args.rms_norm_eps
        if self.args.gemma:  # (1 + w) * normalised x, all in fp32, then rounded once
            w = self._plus_one[id(w)][1]
            if self._kernels is not None and x.dtype == torch.float32 and x.is_contiguous():
                return self._kernels.rms_norm(x, w, eps)
            return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)
        # torch's CPU rms_norm is about eight ops; the kernel is one pass (same fp32 statistics).
        if self._kernels is not None and x.is_contiguous():
            return self._kernels.rms_norm(x, w, eps)
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def _model_dims(self, cache: torch.Tensor, offset: int = 0) -> kernels.ModelDims:
        a, (layers, _, _, kvh, max_len, hd) = self.args, cache.shape
        key = (*cache.shape, offset)
        if self._dims is None or self._dims[0] != key:
            cos, sin = self._kernel_rope(offset)[DEFAULT_KIND]
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
        deepstack: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """tokens [n, L] right-padded, lengths [n], slots [n] -> fp32 logits of each last token.

        A multimodal prompt passes its input embeddings [n * L, D] (images filled in) and its
        M-RoPE rows (`mrope_rows`); it runs the torch attention path. `deepstack` (Qwen3-VL):
        what each of the first layers' outputs add, [n * L, D] each."""
        n, length = tokens.shape
        x = self.embed_tokens(tokens.reshape(-1)) if embeds is None else embeds
        last = torch.arange(n, device=tokens.device) * length + lengths - 1
        if rope is not None:
            c = _Ctx(cache, {DEFAULT_KIND: rope}, n, length, slots=slots, routes=self._routes(),
                     deepstack=deepstack)
            return self._logits(self._layers(x, self._attn_prefill, c, last))
        if self._use_kernels(cache, tokens, lengths, slots):
            # Padding rows write K/V past their prompt's end: harmless, since decode overwrites
            # a position before any query reads it.
            c = _Ctx(
                cache, self.rope32, n * length, length,
                slots=slots.long().repeat_interleave(length),
                positions=torch.arange(length, device=tokens.device).repeat(n),
                routes=self._routes(),
            )
            check_device(tokens.device, [c.slots, c.positions])  # read by the C side
            return self._logits(self._layers(x, self._attn_kernel, c, last))
        # [L, 1, hd] per kind, broadcast over rows and heads
        tables = {kind: (cos[:length, None], sin[:length, None])
                  for kind, (cos, sin) in self.rope.items()}
        c = _Ctx(cache, tables, n, length, slots=slots, routes=self._routes())
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
        x = self.embed_tokens(tokens)
        per_row = isinstance(rope_offset, torch.Tensor)
        if not per_row and self._use_kernels(cache, tokens, positions):
            positions = positions.long().contiguous()
            if isinstance(self._fast, KernelMatmuls) and self.args.plain:
                # One C++ call for the whole step: the kernels below without per-op overhead.
                return self._fast.forward(x, self.norm, cache, positions,
                                          self._model_dims(cache, rope_offset))
            c = _Ctx(cache, self._kernel_rope(rope_offset), n, 0, positions=positions,
                     routes=self._routes())
            return self._logits(self._layers(x, self._attn_kernel, c))
        ctx = self._decode_ctx(cache, positions, attend, positions + rope_offset)
        return self._logits(self._layers(x, self._attn_decode, ctx))

    def _decode_ctx(
        self, cache: torch.Tensor, positions: torch.Tensor, attend: int | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> _Ctx:
        """The masks and cache rows of the torch attention path."""
        n, dev = positions.shape[0], positions.device
        t = int(positions.max()) + 1 if attend is None else attend
        _, _, slots, kvh, max_len, _ = cache.shape
        keys = torch.arange(t, device=dev)
        masks = {}
        for window in set(self.args.windows):
            masked = keys > positions[:, None]  # [n, T]: past each new token
            if window:
                masked |= keys <= positions[:, None] - window
            mask = torch.zeros(n, 1, t, dtype=self.dtype, device=dev)
            mask.masked_fill_(masked[:, None], float("-inf"))
            masks[window] = mask.repeat_interleave(kvh, 0)
        # Row of cache[layer].view(-1, head_dim) for (sequence i, k/v, kv head): matches the
        # order of qkv[:, q_dim:] viewed as [n, 2, kvh, head_dim].
        kv = torch.arange(2, device=dev)[None, :, None]
        head = torch.arange(kvh, device=dev)[None, None, :]
        i = torch.arange(n, device=dev)[:, None, None]
        kv_rows = ((kv * slots + i) * kvh + head) * max_len + positions[:, None, None]
        rot = positions if rope_positions is None else rope_positions
        tables = {kind: (cos[rot, None], sin[rot, None]) for kind, (cos, sin) in self.rope.items()}
        return _Ctx(cache, tables, n, t, kv_rows=kv_rows.reshape(-1), masks=masks,
                    routes=self._routes())
