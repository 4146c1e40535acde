"""The in-process generation engine: `step()` = schedule -> run the model -> sample -> postprocess.

Single-threaded by design: every method must be called from one thread (`AsyncLLMEngine` owns that
thread). A weight update therefore happens between two steps, and the version changes together with
the weights: every token carries the version of the weights that produced its logits.

With `overlap_steps` a decode step is launched before the previous one's tokens are read back: it
takes them from the device as inputs, over the same running set, and the host then reads and
processes the previous step while the device computes. A sequence that stopped in the previous
step got one more row in the launched step, whose result is dropped. The launched step is stamped
with the version it runs under; a weight update, pause or abort first finishes the step in flight
(its finished requests wait in `take_finished` / the next `step`). A prefill, or a request that
waits for a free slot, runs the ordinary way. Running
sequences survive an update; their KV cache is recomputed under the new weights on the next step,
so a response spanning an update holds tokens of both versions and its later tokens are exactly
what the new policy would produce for that prefix.

The engine runs on one device (`EngineSettings.device`): weights, KV cache, RoPE tables and every
per-step tensor live there, and a step ends with one device-to-host copy of the sampled tokens and
their logprobs. The C++ kernels and prepacked matmuls are CPU-only; on CUDA the torch path runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping

import torch

from asyncrl.api import ModelRequest, ModelResponse, StopReason
from asyncrl.inference import kernels
from asyncrl.inference.config import EngineSettings
from asyncrl.inference.decoder_args import DecoderArgs, unsupported_reason
from asyncrl.inference.model_runner import (
    DTYPES,
    ModelRunner,
    load_runner,
    read_eos_ids,
    read_hf_config,
)
from asyncrl.models.routes import RouteRecord
from asyncrl.inference.sampler import Sampler
from asyncrl.inference.scheduler import Batch, Phase, Scheduler, Sequence, SeqStatus
from asyncrl.models.device import resolve_device


logger = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A decode step whose sampled tokens are still on the device."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    logprobs: torch.Tensor
    version: int


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": float32 on CPU (exact logprobs, the fast fp32 kernels), bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class EngineConfig(EngineSettings):
    model_path: str

    @classmethod
    def of(cls, model_path: str | Path, settings: EngineSettings) -> EngineConfig:
        return cls(model_path=str(model_path), **settings.model_dump())


class LLMEngine:
    def __init__(
        self, config: EngineConfig, detokenize: Callable[[list[int]], str] | None = None,
        version: int = 0,
    ) -> None:
        """`version`: of the weights at `config.model_path` (a resumed run's checkpoint)."""
        if version < 0:
            raise ValueError(f"version={version} is out of range; allowed [0, inf)")
        self.config = config
        self.detokenize = detokenize  # needed only by requests with stop strings
        hf_config = read_hf_config(config.model_path)
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, self.device)
        # a vision-language model's language side holds it (Qwen2-VL: text_config)
        max_pos = {**hf_config.get("text_config", {}), **hf_config}.get(
            "max_position_embeddings", 1 << 30)
        self.max_seq_len = config.max_seq_len or max_pos
        if self.max_seq_len > max_pos:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} is out of range; allowed [2, {max_pos}] "
                "(the model's max_position_embeddings)"
            )
        num_slots = self._num_slots(hf_config, dtype)
        self.runner = load_runner(
            config.model_path, config.backend, num_slots, self.max_seq_len, dtype, hf_config,
            self.device, config.fast_matmuls, config.cpu_kernels, config.trust_remote_code,
            config.cuda_graphs, config.record_routes,
        )
        self.route_shape = self._route_shape(hf_config) if config.record_routes else None
        self.vocab_size = self.runner.vocab_size
        eos = [] if config.ignore_eos else read_eos_ids(config.model_path, hf_config)
        self.sampler = Sampler(eos, seed=config.seed, device=self.device)
        self.scheduler = Scheduler(num_slots, self.max_seq_len, config.max_prefill_tokens)
        self.version = version
        self.paused = False
        self._rids: dict[str, Sequence] = {}
        overlap = (self.device.type == "cuda" if config.overlap_steps is None
                   else config.overlap_steps)
        # overlapped steps need the native runner's device-side decode inputs (text models)
        self.overlap = overlap and hasattr(self.runner, "decode_pending") and getattr(
            self.runner, "vision", None) is None and self.route_shape is None
        self._launched: _Launched | None = None  # the step in flight (overlap)
        self._finished: list[ModelResponse] = []  # requests it finished, not returned yet

    def _route_shape(self, hf_config: dict) -> tuple[int, int] | None:
        """(sparse layers, top_k) of the routes each response carries; None where the runner
        cannot record them (the transformers fallback: said once). A dense model is refused."""
        reason = unsupported_reason(hf_config, self.max_seq_len)
        moe = None if reason else DecoderArgs.from_hf_config(hf_config, self.max_seq_len).moe
        if moe is None and not reason:
            raise ValueError("record_routes=True needs a mixture-of-experts model; "
                             f"{self.config.model_path} has no sparse layer")
        if not isinstance(self.runner, ModelRunner):
            logger.warning("record_routes: the transformers fallback does not record routes "
                           "(%s); responses carry none", reason or "backend hf")
            return None
        return moe.num_sparse, moe.top_k

    def _num_slots(self, hf_config: dict, dtype: torch.dtype) -> int:
        """KV cache slots: max_num_seqs, capped by kv_cache_bytes, or on CUDA by a share of the
        free GPU memory (one slot reserves max_seq_len positions, ~0.4 GB for Qwen2.5-0.5B at
        32k in bf16, so max_num_seqs slots rarely fit)."""
        cfg = self.config
        if cfg.backend == "hf" or unsupported_reason(hf_config, self.max_seq_len):
            return cfg.max_num_seqs  # the fallback keeps no cache
        args = DecoderArgs.from_hf_config(hf_config, self.max_seq_len)
        per_slot = ModelRunner.bytes_per_slot(args, self.max_seq_len, dtype)
        need = f"one sequence of max_seq_len={self.max_seq_len} needs {per_slot} bytes"
        if cfg.kv_cache_bytes is not None:
            if cfg.kv_cache_bytes < per_slot:
                raise ValueError(
                    f"kv_cache_bytes={cfg.kv_cache_bytes} is out of range; {need} (raise "
                    "kv_cache_bytes or lower max_seq_len)"
                )
            return min(cfg.max_num_seqs, cfg.kv_cache_bytes // per_slot)
        if self.device.type != "cuda":
            return cfg.max_num_seqs
        free = torch.cuda.mem_get_info(self.device)[0]
        weights = args.num_parameters() * dtype.itemsize
        budget = int(cfg.gpu_memory_fraction * free) - weights
        if budget < per_slot:
            raise ValueError(
                f"no KV cache slot fits on {self.device}: gpu_memory_fraction="
                f"{cfg.gpu_memory_fraction} of {free / 2**30:.2f} GiB free, less "
                f"{weights / 2**30:.2f} GiB of weights, leaves {max(budget, 0)} bytes and {need}; "
                "lower max_seq_len, raise gpu_memory_fraction, or set kv_cache_bytes"
            )
        return min(cfg.max_num_seqs, budget // per_slot)

    # ---- requests -------------------------------------------------------------------------

    def validate(self, req: ModelRequest) -> None:
        """Raise ValueError for a request this engine cannot serve exactly (never truncates)."""
        g = req.gconfig
        if g.n_samples != 1:
            raise ValueError(
                f"n_samples={g.n_samples} is out of range; allowed [1, 1]: the engine returns one "
                "sequence per request, so submit one ModelRequest per sample"
            )
        if not req.input_ids:
            raise ValueError("input_ids is empty: a prompt needs at least one token")
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"input_ids contain {bad[:5]} out of range; allowed [0, {self.vocab_size - 1}]"
            )
        bad = [t for t in g.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids contain {bad[:5]} out of range; allowed [0, {self.vocab_size - 1}]"
            )
        total = len(req.input_ids) + g.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(req.input_ids)} tokens) + max_new_tokens ({g.max_new_tokens}) = "
                f"{total} is out of range; allowed <= max_seq_len={self.max_seq_len}"
            )
        if g.stop and self.detokenize is None:
            raise ValueError(f"stop={g.stop} needs an engine built with a detokenize callback")
        self.runner.check_images(req.input_ids, req.images)
        if req.rid in self._rids:
            raise ValueError(f"request id {req.rid!r} is already in flight")

    def add_request(self, req: ModelRequest) -> None:
        self.validate(req)
        seq = Sequence(req.rid, list(req.input_ids), req.gconfig, images=req.images,
                       routes=RouteRecord(*self.route_shape) if self.route_shape else None)
        self._rids[req.rid] = seq
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._launched is not None or bool(self._finished)

    def take_finished(self) -> list[ModelResponse]:
        """Requests finished outside `step` (by finishing the step in flight before an update,
        pause or abort), not returned yet."""
        out, self._finished = self._finished, []
        return out

    def get_sequence(self, rid: str) -> Sequence | None:
        """The live state of an unfinished request (read-only for callers)."""
        return self._rids.get(rid)

    def stats(self) -> dict[str, float]:
        s = self.scheduler
        return {
            "waiting": len(s.waiting),
            "running": len(s.running),
            "kv_cache_usage": len(s.running) / s.num_slots,
            "version": self.version,
            "paused": float(self.paused),
        }

    # ---- the request path -----------------------------------------------------------------

    def step(self) -> list[ModelResponse]:
        """Advance every scheduled sequence by one token; return the requests that finished."""
        out = self.take_finished()
        kernels.use_threads(self.config.num_threads)
        launched, self._launched = self._launched, None
        if launched is not None:  # overlap: launch the next decode, then read this one
            if self._chains(launched):
                self._launched = self._launch(
                    launched.seqs, self.runner.decode_pending(launched.seqs, launched.tokens), 1)
            return out + self._collect(launched)
        batch = None if self.paused else self.scheduler.schedule()
        if batch is None:
            return out
        logits = self.runner.run(batch)
        if self.route_shape is not None:
            self._keep_routes(batch)
        if self.overlap and batch.phase == Phase.DECODE:
            self._launched = self._launch(batch.seqs, logits, 0)
            return out
        sampled = self.sampler(logits, batch.seqs)
        return out + self._postprocess(batch, sampled.tokens, sampled.logprobs, self.version)

    def _keep_routes(self, batch: Batch) -> None:
        """Each sequence's routes from the step just run: a prefill's for every token it
        computed (replacing older ones), a decode's for the token it read."""
        seqs = batch.seqs
        if batch.phase == Phase.PREFILL:
            width = max(q.num_tokens for q in seqs)
            rows = self.runner.routes(len(seqs) * width)
            for i, q in enumerate(seqs):
                q.routes.write(0, rows[i * width:i * width + q.num_tokens])
            return
        rows = self.runner.routes(len(seqs))
        for i, q in enumerate(seqs):
            q.routes.write(q.num_tokens - 1, rows[i:i + 1])

    def _launch(self, seqs: list[Sequence], logits: torch.Tensor, pending: int) -> _Launched:
        tokens, logprobs = self.sampler.draw(logits, seqs, pending)
        return _Launched(list(seqs), tokens, logprobs, self.version)

    def _chains(self, launched: _Launched) -> bool:
        """Whether the next step is a decode of the same running set: nothing to prefill (no
        request waits for a free slot, no cache was invalidated) and not paused."""
        s = self.scheduler
        same = len(s.running) == len(launched.seqs) and all(
            a is b for a, b in zip(s.running, launched.seqs))
        return (not self.paused and same
                and not (s.waiting and len(s.running) < s.num_slots)
                and all(q.num_cached > 0 for q in s.running))

    def _collect(self, launched: _Launched) -> list[ModelResponse]:
        """Read a launched step's tokens and process them; rows of sequences that stopped
        meanwhile are dropped."""
        sampled = self.sampler.to_host(launched.tokens, launched.logprobs)
        keep = [i for i, q in enumerate(launched.seqs) if q.status != SeqStatus.FINISHED]
        return self._postprocess(Batch(Phase.DECODE, [launched.seqs[i] for i in keep]),
                                 [sampled.tokens[i] for i in keep],
                                 [sampled.logprobs[i] for i in keep], launched.version)

    def _finish_launched(self) -> None:
        """Finish the step in flight (before an update, pause or abort)."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self._finished += self._collect(launched)

    def _postprocess(
        self, batch: Batch, tokens: list[int], logprobs: list[float], version: int
    ) -> list[ModelResponse]:
        now = time.perf_counter()
        finished: dict[StopReason, list[Sequence]] = {}
        for seq, token, logprob in zip(batch.seqs, tokens, logprobs):
            # Everything but the newest token is now in the cache (a prefill cached all of it).
            seq.num_cached = seq.num_tokens if batch.phase == Phase.PREFILL else seq.num_cached + 1
            seq.append(token, logprob, version, now)
            reason = self._stop_reason(seq)
            if reason is not None:
                finished.setdefault(reason, []).append(seq)
        return [out for reason, seqs in finished.items() for out in self._finish(seqs, reason)]

    def _stop_reason(self, seq: Sequence) -> StopReason | None:
        g = seq.gconfig
        if seq.num_outputs > g.min_new_tokens:  # the sampler suppresses stop ids before that
            if seq.token_ids[-1] in self.sampler.stop_ids(seq):
                return StopReason.STOP
            # Whole-output decode: simple and exact for multi-token / multi-byte stops; the cost
            # only hits requests that ask for stop strings.
            if g.stop and any(s in self.detokenize(seq.output_tokens) for s in g.stop):
                return StopReason.STOP
        if seq.num_outputs >= g.max_new_tokens or seq.num_tokens >= self.max_seq_len:
            return StopReason.LENGTH
        return None

    def _finish(self, seqs: list[Sequence], reason: StopReason) -> list[ModelResponse]:
        self.runner.move_slots(self.scheduler.release(seqs, reason))
        out = []
        for seq in seqs:
            del self._rids[seq.rid]
            latency = seq.finish_time - seq.arrival
            ttft = seq.first_token_time - seq.arrival if seq.first_token_time else latency
            out.append(
                ModelResponse(
                    input_tokens=seq.prompt,
                    output_tokens=seq.output_tokens,
                    output_logprobs=seq.output_logprobs,
                    output_versions=seq.output_versions,
                    stop_reason=reason,
                    latency=latency,
                    ttft=ttft,
                    rid=seq.rid,
                    routes=None if seq.routes is None else seq.routes.routes(seq.num_tokens),
                )
            )
        return out

    # ---- control --------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop scheduling; requests stay queued/running until `resume` or `abort`."""
        self._finish_launched()
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def abort(self, rid: str | None = None) -> list[ModelResponse]:
        """Finish `rid` (every unfinished request when None) now, with the tokens it has; also
        returns the requests the step in flight finished."""
        self._finish_launched()
        return self.take_finished() + self._finish(self.scheduler.find(rid), StopReason.ABORT)

    def update_weights_from_state_dict(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int, strict: bool = True,
    ) -> None:
        """Swap weights in place and set the version; running sequences recompute their cache."""
        if version < 0:
            raise ValueError(f"version={version} is out of range; allowed [0, inf]")
        self._finish_launched()  # its tokens came from the old weights, under the old version
        self.runner.load_weights(weights, strict=strict)
        self.version = version
        self.scheduler.invalidate_cache()

    def generate(self, requests: list[ModelRequest]) -> list[ModelResponse]:
        """Run `requests` to completion (blocking); responses in request order."""
        if self.paused:
            raise RuntimeError("generate() on a paused engine would never finish; resume() first")
        for req in requests:
            self.add_request(req)
        done: dict[str, ModelResponse] = {}
        while self.has_unfinished():
            done.update((r.rid, r) for r in self.step())
        return [done[r.rid] for r in requests]
