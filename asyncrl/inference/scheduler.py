"""Continuous batching over a slot-based KV cache: which sequences run in the next engine step.

The KV cache is a preallocated tensor `[num_layers, 2, num_slots, num_kv_heads, max_seq_len,
head_dim]`; each running sequence owns one slot (a row of max_seq_len positions). Slots instead of
pages because this engine runs attention with plain torch ops on CPU: there is no paged-attention
kernel, so paged blocks would have to be gathered into a contiguous tensor every layer of every
step, a copy of the whole live cache. With slots, and with the running set kept *compact* (running
sequence i always sits in slot i), the decode batch reads `cache[layer, :, :n, :, :T]`, a view. The
cost is that every slot reserves max_seq_len positions, so admission is by free slots, and the slot
count follows from the memory budget (`EngineConfig.kv_cache_bytes`). When a sequence finishes, a
survivor from the end moves into its slot (`release` returns the copies for the model runner).

A step is either a prefill (newly admitted sequences, or running ones whose cache was invalidated
by a weight update, computed from position 0) or a decode (every running sequence advances by one
token). Prefill comes first so new requests join as soon as slots free up; running sequences wait
out that one step (mixing both phases in one forward is a possible refinement). This module is
plain Python: no tensors, unit-testable without a model.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from asyncrl.api import GenerationConfig, StopReason, check_range


class SeqStatus(str, Enum):
    WAITING = "waiting"  # queued, no slot yet
    RUNNING = "running"  # owns a slot
    FINISHED = "finished"  # released; stop_reason says why


class Phase(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)  # identity equality: two requests with equal prompts are different sequences
class Sequence:
    """One request's state: prompt + generated tokens, its slot and how much of it is cached."""

    rid: str
    prompt: list[int]
    gconfig: GenerationConfig
    arrival: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    slot: int = -1
    # Tokens whose K/V are in the cache. Decode needs num_cached == num_tokens - 1 (all but the
    # newest token); 0 means the sequence must be (re)computed by a prefill.
    num_cached: int = 0
    stop_reason: StopReason | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    sampler_state: Any = None  # the per-request torch.Generator, owned by the sampler
    images: Any = None  # the prompt's ImageInputs (a vision-language model's runner reads them)
    rope_delta: int = 0  # M-RoPE: rotary position - cache position past the prompt (runner's)
    routes: Any = None  # routes.RouteRecord: the experts each token was routed to (engine's)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - len(self.prompt)

    @property
    def output_tokens(self) -> list[int]:
        return self.token_ids[len(self.prompt):]

    def append(self, token: int, logprob: float, version: int, now: float) -> None:
        self.token_ids.append(token)
        self.output_logprobs.append(logprob)
        self.output_versions.append(version)
        if self.first_token_time is None:
            self.first_token_time = now


@dataclass
class Batch:
    phase: Phase
    seqs: list[Sequence]


class Scheduler:
    """Admission, prefill/decode choice and slot bookkeeping for the engine's step loop."""

    def __init__(self, num_slots: int, max_seq_len: int, max_prefill_tokens: int) -> None:
        check_range("num_slots", num_slots, lo=1)
        check_range("max_seq_len", max_seq_len, lo=2)
        check_range("max_prefill_tokens", max_prefill_tokens, lo=1)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        # Bounds the padded [batch, longest prompt] activations of one prefill step.
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # invariant: running[i].slot == i

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.max_seq_len:
            raise ValueError(
                f"sequence {seq.rid} has {seq.num_tokens} tokens; allowed < max_seq_len="
                f"{self.max_seq_len} so at least one token can be generated"
            )
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        """Prefill what needs it (up to the token budget), otherwise decode every running seq."""
        chosen: list[Sequence] = []
        longest = 0

        def fits(seq: Sequence) -> bool:
            # Prefill pads to the longest sequence; always take one so a long prompt cannot starve.
            width = max(longest, seq.num_tokens)
            return not chosen or (len(chosen) + 1) * width <= self.max_prefill_tokens

        for seq in self.running:  # cache invalidated by a weight update: recompute first
            if seq.num_cached == 0 and fits(seq):
                chosen.append(seq)
                longest = max(longest, seq.num_tokens)
        while self.waiting and len(self.running) < self.num_slots and fits(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.status, seq.slot = SeqStatus.RUNNING, len(self.running)
            self.running.append(seq)
            chosen.append(seq)
            longest = max(longest, seq.num_tokens)
        if chosen:
            return Batch(Phase.PREFILL, chosen)
        if self.running:
            return Batch(Phase.DECODE, list(self.running))
        return None

    def invalidate_cache(self) -> None:
        """Running sequences keep their slots but recompute their K/V (e.g. under new weights)."""
        for seq in self.running:
            seq.num_cached = 0

    def release(self, seqs: list[Sequence], reason: StopReason) -> list[tuple[int, int]]:
        """Finish `seqs` (running or waiting) and re-compact the running set.

        Returns the (src_slot, dst_slot) cache copies the model runner must do, in order, before
        the next forward: survivors beyond the new running count move into the freed low slots.
        """
        if not seqs:
            return []
        now = time.perf_counter()
        gone = set(map(id, seqs))
        for seq in seqs:
            if seq.status == SeqStatus.FINISHED:
                raise ValueError(f"sequence {seq.rid} was already released")
            seq.status, seq.stop_reason, seq.finish_time = SeqStatus.FINISHED, reason, now
        if any(s.slot < 0 for s in seqs):
            self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        survivors = [s for s in self.running if id(s) not in gone]
        n = len(survivors)
        holes = sorted(s.slot for s in seqs if 0 <= s.slot < n)
        movers = [s for s in survivors if s.slot >= n]
        moves = []
        for seq, dst in zip(movers, holes):
            moves.append((seq.slot, dst))
            seq.slot = dst
        for seq in seqs:
            seq.slot = -1
        survivors.sort(key=lambda s: s.slot)
        self.running = survivors
        return moves

    def find(self, rid: str | None) -> list[Sequence]:
        """Unfinished sequences with this request id (all of them when rid is None)."""
        seqs = [*self.running, *self.waiting]
        return seqs if rid is None else [s for s in seqs if s.rid == rid]
