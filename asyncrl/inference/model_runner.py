"""Loads a model directory and runs one scheduled batch: Sequences in, last-position logits out.

`ModelRunner` drives the compact decoder (`decoder.py`: Llama, Mistral, Qwen2/3, Gemma 3,
Qwen3-MoE, Mixtral) over a preallocated KV cache and is the fast path. `HFModelRunner` is the
fallback for architectures the compact decoder does not implement: it runs the transformers model
over every sequence's full token list each step (no cache reuse), which is slow but exact for
anything `AutoModelForCausalLM` loads; `load_runner` logs why and what it costs when it picks it.
Both read the weights' HF names, so the trainer's state dict or safetensors directory updates
either one.

Both live on one device: each step builds its inputs on the host as Python lists and moves them
with one copy per tensor; incoming weights (any device) are copied into the device's tensors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from asyncrl.errors import UserError
from asyncrl.inference.decoder import DecoderModel, check_device
from asyncrl.inference.decoder_args import DecoderArgs, unsupported_reason
from asyncrl.inference.scheduler import Batch, Phase, Sequence
from asyncrl.inference.vision_tower import (
    VisionTower,
    check_image_tokens,
    is_vlm_config,
    mrope_positions,
)
from asyncrl.models.weight_names import split_vlm_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
logger = logging.getLogger(__name__)


class NativeUnsupportedError(UserError):
    """`inference.engine.backend: native` on a model the compact decoder cannot serve; the
    message names the setting, the reason and the alternatives."""


class Runner(Protocol):
    vocab_size: int

    def run(self, batch: Batch) -> torch.Tensor: ...

    def move_slots(self, moves: list[tuple[int, int]]) -> None: ...

    def load_weights(self, weights: Mapping[str, torch.Tensor], strict: bool = True) -> None: ...

    def routes(self, rows: int) -> Any:
        """The expert choices of the last forward's first `rows` rows (models/routes.py's table), or
        None: not recorded."""

    def check_images(self, input_ids: list[int], images: Any) -> None:
        """Raise ValueError unless this runner can serve this prompt with these images (None:
        a text prompt)."""


def read_hf_config(path: str | Path) -> dict:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"model path {str(path)!r} has no config.json (expected an HF model dir)")
    return json.loads(cfg_file.read_text())


def read_eos_ids(path: str | Path, hf_config: Mapping) -> list[int]:
    """EOS ids from generation_config.json (what `generate` uses), else from config.json."""
    eos = hf_config.get("eos_token_id")
    gen_file = Path(path) / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def iter_safetensors(path: str | Path) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from one .safetensors file or a model directory's weight files (the
    shards its model.safetensors.index.json names, else model.safetensors: `weight_files`).

    A path that is not readable safetensors raises ValueError naming it (the path is the
    caller's input: over HTTP, a 400)."""
    from safetensors import SafetensorError, safe_open

    from asyncrl.models.export import weight_files

    p = Path(path)
    files = weight_files(p) if p.is_dir() else [p]
    if not files or not files[0].is_file():
        raise ValueError(f"no .safetensors weights at {str(p)!r}")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except (OSError, SafetensorError) as err:
            raise ValueError(f"cannot read .safetensors weights at {str(file)!r}: {err}") from err


def bucket(n: int, cap: int) -> int:
    """The smallest power of two >= n, at most `cap`."""
    return min(cap, 1 << max(0, n - 1).bit_length())


class StaticDecode:
    """Decode steps whose shapes come from a few buckets: the batch rounded up to a power of two
    (padding rows sit in free cache slots: the running set is compact, so slots n.. hold no live
    sequence, and a prefill rewrites every position before a query reads it) and the attended
    length rounded up likewise (the extra keys are masked). Inputs go through preallocated
    buffers (pinned on the host, one copy to the device), masks and RoPE rows are built on the
    device from the positions, and nothing reads the device back: the sampler's result is the
    step's one host sync.

    With `cuda_graphs`, each (batch, length) bucket's step (layers and head; sampling stays
    outside) is captured as a CUDA graph on its first use and replayed after: the inputs, the
    cache, the weights (updated in place, `DecoderModel.load_weights`) and the logits buffer keep
    their addresses, so a graph stays valid across weight updates. Graphs share one memory pool
    (one runs at a time) and write one logits buffer. A bucket whose capture fails runs eagerly,
    logged once.
    """

    def __init__(self, num_slots: int, max_seq_len: int, device: torch.device,
                 cuda_graphs: bool = False) -> None:
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        # a step of `rows` rows reads [tokens, positions, rope deltas] from the first 3 * rows
        # entries: one contiguous copy from pinned host memory. Two host buffers take turns, and
        # one is rewritten only once its last copy has landed (an overlapped step is written
        # while the previous one may still be queued on the device).
        cuda = device.type == "cuda"
        self.host = [torch.zeros(3 * num_slots, dtype=torch.long, pin_memory=cuda)
                     for _ in range(2)]
        self.copied: list[Any] = [None, None]  # the CUDA event after each buffer's last copy
        self.turn = 0
        self.inputs = torch.zeros(3 * num_slots, dtype=torch.long, device=device)
        self.graphs_on = cuda_graphs and device.type == "cuda"
        self.graphs: dict[tuple[int, int], Any] = {}  # bucket -> CUDAGraph, or None: eager
        self.logits: torch.Tensor | None = None
        self.pool: Any = None
        self.capture_seconds = 0.0  # spent capturing, for benchmarks

    def decode(self, model: DecoderModel, cache: torch.Tensor, tokens: list[int] | torch.Tensor,
               positions: list[int], deltas: list[int]) -> torch.Tensor:
        """Logits [n, V] of the n running sequences' next tokens (`tokens` from the host, or
        already on the device)."""
        n = len(positions)
        rows = bucket(n, self.num_slots)
        attend = bucket(max(positions) + 1, self.max_seq_len)
        pad = [0] * (rows - n)
        host_tokens = [0] * rows if isinstance(tokens, torch.Tensor) else tokens + pad
        self.turn ^= 1
        host, done = self.host[self.turn], self.copied[self.turn]
        if done is not None:
            done.synchronize()
        host[:3 * rows] = torch.tensor(host_tokens + positions + pad + deltas + pad)
        self.inputs[:3 * rows].copy_(host[:3 * rows], non_blocking=True)
        if self.inputs.is_cuda:
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()
        if isinstance(tokens, torch.Tensor):
            self.inputs[:n].copy_(tokens)
        tok, pos, delta = self.inputs[:3 * rows].view(3, rows)
        if self.graphs_on:
            key = (rows, attend)
            if key not in self.graphs:
                self.graphs[key] = self._capture(key, model, cache, tok, pos, delta)
            graph = self.graphs[key]
            if graph is not None:
                graph.replay()
                return self.logits[:n]
        same = len(set(deltas)) == 1
        return model.decode(tok, pos, cache, attend=attend,
                            rope_offset=deltas[0] if same else delta)[:n]

    def _capture(self, key: tuple[int, int], model: DecoderModel, cache: torch.Tensor,
                 tok: torch.Tensor, pos: torch.Tensor, delta: torch.Tensor) -> Any:
        """The bucket's graph, after one eager warm-up run on a side stream (it writes this
        step's K/V, which the replay writes again, identically); None if capture fails."""
        import time

        start = time.perf_counter()
        rows, attend = key
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                warm = model.decode(tok, pos, cache, attend=attend, rope_offset=delta)
            torch.cuda.current_stream().wait_stream(side)
            if self.logits is None:
                self.logits = torch.empty(self.num_slots, warm.shape[1], dtype=warm.dtype,
                                          device=warm.device)
                self.pool = torch.cuda.graph_pool_handle()
            del warm
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = model.decode(tok, pos, cache, attend=attend, rope_offset=delta)
                self.logits[:rows].copy_(out)
        except RuntimeError as err:
            logger.warning("decode bucket of %d rows x %d positions runs without a CUDA graph: "
                           "its capture failed (%s)", rows, attend, err)
            return None
        self.capture_seconds += time.perf_counter() - start
        return graph


class ModelRunner:
    """The compact model plus its KV cache `[layers, 2, slots, kv_heads, max_seq_len, head_dim]`;
    for a vision-language model also its vision tower (`vision_tower.py`)."""

    def __init__(
        self, args: DecoderArgs, num_slots: int, max_seq_len: int, dtype: torch.dtype,
        device: torch.device | str = "cpu", fast_matmuls: bool = True, cpu_kernels: bool = True,
        vision: VisionTower | None = None, static_decode: bool | None = None,
        cuda_graphs: bool = True, record_routes: bool = False,
    ) -> None:
        """`static_decode` (default: on CUDA): decode steps of bucketed shapes, replayed as CUDA
        graphs with `cuda_graphs` (`StaticDecode`). `record_routes`: a mixture-of-experts model
        keeps each forward's expert choices (`routes`)."""
        self.device = torch.device(device)
        self.vision = vision
        # The decode batch is at most num_slots rows: the packed weight layout is tuned for it.
        self.model = DecoderModel(
            args, dtype, self.device, rows_hint=num_slots, fast_matmuls=fast_matmuls,
            cpu_kernels=cpu_kernels, max_seq_len=max_seq_len, record_routes=record_routes,
        )
        self.vocab_size = args.vocab_size
        # Zeros, not empty: masked positions are still multiplied, and NaN garbage * 0 stays NaN.
        self.cache = torch.zeros(
            args.num_layers, 2, num_slots, args.num_kv_heads, max_seq_len, args.head_dim,
            dtype=dtype, device=self.device,
        )
        check_device(self.device, [self.cache])
        on = self.device.type == "cuda" if static_decode is None else static_decode
        # a mixture-of-experts layer reads its per-expert row counts on the host: not capturable
        self.static = (StaticDecode(num_slots, max_seq_len, self.device,
                                    cuda_graphs and args.moe is None) if on else None)

    def routes(self, rows: int) -> Any:
        """The experts the last forward's first `rows` rows were routed to (int16 numpy
        [rows, sparse layers, top_k]; a prefill's rows are its [n, L] padded prompts, flat), or
        None when this runner records none."""
        got = self.model.last_routes
        return None if got is None else got[:rows].to("cpu", torch.int16).numpy()

    @staticmethod
    def bytes_per_slot(args: DecoderArgs, max_seq_len: int, dtype: torch.dtype) -> int:
        per_position = args.num_layers * 2 * args.num_kv_heads * args.head_dim * dtype.itemsize
        return per_position * max_seq_len

    def _tensor(self, data: list) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def run(self, batch: Batch) -> torch.Tensor:
        seqs = batch.seqs
        ids = [self._readable(s) for s in seqs]
        if batch.phase == Phase.DECODE:
            return self._decode(seqs, [x[-1] for x in ids], [s.num_tokens - 1 for s in seqs])
        lengths = [s.num_tokens for s in seqs]
        width = max(lengths)
        tokens = self._tensor([x + [0] * (width - len(x)) for x in ids])
        slots = self._tensor([s.slot for s in seqs])
        if self.vision is not None and any(s.images is not None for s in seqs):
            return self._prefill_images(seqs, ids, tokens, lengths, slots)
        return self.model.prefill(tokens, self._tensor(lengths), slots, self.cache)

    def decode_pending(self, seqs: list[Sequence], tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the decode step that reads each running sequence's drawn token that it does
        not hold yet (`tokens` [n], still on the device: an overlapped step), at position
        num_tokens. Text models only (a VLM maps generated ids on the host)."""
        return self._decode(seqs, tokens, [s.num_tokens for s in seqs])

    def _decode(self, seqs: list[Sequence], tokens: list[int] | torch.Tensor,
                positions: list[int]) -> torch.Tensor:
        deltas = [s.rope_delta for s in seqs]
        if self.static is not None:
            return self.static.decode(self.model, self.cache, tokens, positions, deltas)
        # one delta (every prompt of a group; the kernels' case) or one per row
        offset = deltas[0] if len(set(deltas)) == 1 else self._tensor(deltas)
        if not isinstance(tokens, torch.Tensor):
            tokens = self._tensor(tokens)
        # The attended length from the host list: no device sync to read positions.max().
        return self.model.decode(tokens, self._tensor(positions), self.cache,
                                 attend=max(positions) + 1, rope_offset=offset)

    def _readable(self, seq: Sequence) -> list[int]:
        """The ids the model reads: a VLM reads generated vision tokens as 0 (vision_tower)."""
        if self.vision is None:
            return seq.token_ids
        return self.vision.readable_ids(seq.token_ids, len(seq.prompt))

    @torch.inference_mode()
    def _prefill_images(self, seqs: list[Sequence], ids: list[list[int]], tokens: torch.Tensor,
                        lengths: list[int], slots: torch.Tensor) -> torch.Tensor:
        """Prompts with images: each prompt's image tokens take its vision tower output (once
        per prompt: cached by digest), and every token its M-RoPE position; each sequence keeps
        its rope delta for decoding."""
        vision, n, width = self.vision, len(seqs), tokens.shape[1]
        positions = torch.zeros(3, n, width, dtype=torch.long)
        x = self.model.embed_tokens(tokens).view(n, width, -1)
        with_images = [row for row, s in enumerate(seqs) if s.images is not None]
        embeds = vision.embed([seqs[row].images for row in with_images])
        deep: list[torch.Tensor] = []  # Qwen3-VL: per decoder layer, [n, width, hidden]
        for row, image_embeds in zip(with_images, embeds):
            at = tokens[row] == vision.image_token_id
            if image_embeds.dim() == 3:  # merged output, then the DeepStack features
                if not deep:
                    deep = [torch.zeros_like(x) for _ in range(image_embeds.shape[0] - 1)]
                for layer, feature in zip(deep, image_embeds[1:]):
                    layer[row, at] = feature.to(x.dtype)
                image_embeds = image_embeds[0]
            x[row, at] = image_embeds.to(x.dtype)
        for row, (seq, seq_ids) in enumerate(zip(seqs, ids)):
            grids = seq.images.grid_thw.tolist() if seq.images is not None else []
            streams, seq.rope_delta = mrope_positions(seq_ids, vision.image_token_id, grids,
                                                      vision.merge)
            positions[:, row, :len(seq_ids)] = torch.tensor(streams)
        return self.model.prefill(tokens, self._tensor(lengths), slots, self.cache,
                                  embeds=x.view(n * width, -1),
                                  rope=self.model.mrope_rows(positions),
                                  deepstack=[d.view(n * width, -1) for d in deep])

    @torch.inference_mode()
    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        # Whole rows are copied: positions past a sequence's length are masked, so no need to
        # track lengths here, and one strided copy beats a per-length slice on this scale.
        for src, dst in moves:
            self.cache[:, :, dst].copy_(self.cache[:, :, src])

    def load_weights(self, weights, strict: bool = True) -> None:
        if self.vision is None:
            self.model.load_weights(weights, strict=strict)
            return
        parts: dict[str, list] = {"language": [], "vision": []}
        for name, tensor in weights.items() if isinstance(weights, Mapping) else weights:
            part, inner = split_vlm_name(name)
            parts[part].append((inner, tensor))
        self.vision.load_weights(parts["vision"], strict)  # checks all before copying any
        self.model.load_weights(parts["language"], strict=strict)

    def check_images(self, input_ids: list[int], images: Any) -> None:
        if self.vision is None:
            if images is not None:
                raise ValueError("this is a text-only model; a prompt with images needs a "
                                 "vision-language model")
            return
        check_image_tokens(input_ids, images, self.vision.image_token_id, self.vision.merge)


class HFModelRunner:
    """Fallback: the transformers model recomputes each sequence from scratch every step."""

    def __init__(
        self, path: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu",
        trust_remote_code: bool = False,
    ) -> None:
        from asyncrl.models.config import is_vision_language
        from asyncrl.models.export import policy_model_class
        from asyncrl.models.loading import check_remote_code

        self.device = torch.device(device)
        check_remote_code(Path(path), trust_remote_code)
        self.vision = is_vision_language(path)
        model = policy_model_class(self.vision).from_pretrained(
            str(path), dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code)
        self.model = model.to(self.device).eval()
        cfg = self.model.config
        self.vocab_size = getattr(cfg, "vocab_size", None) or cfg.get_text_config().vocab_size
        self.pad_id = 0

    def check_images(self, input_ids: list[int], images: Any) -> None:
        if images is not None and not self.vision:
            raise ValueError(f"{type(self.model).__name__} is a text-only model; a prompt with "
                             "images needs a vision-language model")
        if self.vision:
            cfg = self.model.config
            check_image_tokens(input_ids, images, cfg.image_token_id,
                               cfg.vision_config.spatial_merge_size)

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        lengths = [s.num_tokens for s in batch.seqs]
        width = max(lengths)
        # Left padding: every last token is in the last column.
        ids = [[self.pad_id] * (width - n) + s.token_ids for n, s in zip(lengths, batch.seqs)]
        mask = [[0] * (width - n) + [1] * n for n in lengths]
        ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        attn = torch.tensor(mask, dtype=torch.long, device=self.device)
        if self.vision:  # multimodal positions: the model derives them from the mask
            return self.model(attention_mask=attn, use_cache=False,
                              **self._image_kwargs(batch, ids)).logits[:, -1].float()
        positions = (attn.cumsum(-1) - 1).clamp_min(0)
        out = self.model(
            input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False
        )
        return out.logits[:, -1].float()

    def _image_kwargs(self, batch: Batch, ids: torch.Tensor) -> dict:
        """The batch's images (recomputed every step: this runner keeps no cache) filling each
        row's prompt image tokens; rows are left-padded, so a prompt starts at width - n."""
        from asyncrl.models.vision import vlm_forward_kwargs

        width = ids.shape[1]
        prompt = torch.zeros_like(ids, dtype=torch.bool)
        for row, seq in enumerate(batch.seqs):
            start = width - seq.num_tokens
            prompt[row, start:start + len(seq.prompt)] = True
        return vlm_forward_kwargs(self.model, ids, prompt,
                                  [s.images for s in batch.seqs if s.images is not None])

    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        pass  # no cache

    @torch.inference_mode()
    def routes(self, rows: int) -> None:
        return None  # transformers' model does not hand its routing out

    def load_weights(self, weights, strict: bool = True) -> None:
        sd = dict(weights.items() if isinstance(weights, Mapping) else weights)
        params = dict(self.model.named_parameters())
        unknown = sorted(set(sd) - set(self.model.state_dict()))
        if unknown:
            raise ValueError(f"unknown weights for {type(self.model).__name__}: {unknown[:3]}")
        missing = sorted(set(params) - set(sd))
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        missing = [m for m in missing if not (tied and m == "lm_head.weight")]
        if strict and missing:
            raise ValueError(f"{len(missing)} weights missing from the update, e.g. {missing[:3]}")
        self.model.load_state_dict(sd, strict=False)


def load_runner(
    path: str | Path, backend: str, num_slots: int, max_seq_len: int, dtype: torch.dtype,
    hf_config: Mapping, device: torch.device | str = "cpu", fast_matmuls: bool = True,
    cpu_kernels: bool = True, trust_remote_code: bool = False, cuda_graphs: bool = True,
    record_routes: bool = False,
) -> Runner:
    """`backend`: "native" (compact decoder; NativeUnsupportedError if it cannot serve the
    model), "hf", or "auto" (native when it can, else the transformers fallback, logged)."""
    reason = unsupported_reason(hf_config, max_seq_len)
    if backend == "auto" and reason:
        logger.warning(
            "the built-in engine serves %s through transformers, much slower: it keeps no KV "
            "cache, so each generated token costs a forward pass over its whole sequence "
            "instead of one token (inference.engine.backend=auto; reason: %s)", path, reason)
    if backend == "hf" or (backend == "auto" and reason):
        return HFModelRunner(path, dtype, device, trust_remote_code)
    if reason:
        raise NativeUnsupportedError(
            f"inference.engine.backend='native' cannot serve {str(path)!r}: {reason}; set "
            "inference.engine.backend to 'auto' (native where it can, else transformers) or 'hf'")
    args = DecoderArgs.from_hf_config(hf_config, max_seq_len)
    vision = (VisionTower(str(path), hf_config, dtype, torch.device(device))
              if is_vlm_config(hf_config) else None)
    runner = ModelRunner(args, num_slots, max_seq_len, dtype, device, fast_matmuls, cpu_kernels,
                         vision, cuda_graphs=cuda_graphs, record_routes=record_routes)
    # Host-staged, then copied into the preallocated device tensors: `load_weights` holds every
    # tensor until all are checked, and staging on the GPU would double its peak memory.
    runner.load_weights(iter_safetensors(path))
    return runner
