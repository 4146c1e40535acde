"""Discrete-event model of synchronous vs asynchronous RL at equal hardware, in virtual time.

`simulate(SimConfig)` plays `steps` training steps of the loop `prepare_batch -> train -> pause ->
weight sync -> version + 1 -> resume` against N virtual inference servers and returns throughput,
utilisation and the staleness actually consumed. Admission and consumption are NOT modelled here:
they are the real `asyncrl.rollout.staleness.StalenessManager` (capacity rule, oldest-start-first
consumption, trajectories staler than eta dropped and their prompts re-queued at the front), driven
the way `WorkflowExecutor.prepare_batch` drives it (by default the pending queue is topped up on
every prepare_batch call, as the executor does; `SimConfig.refill` models alternatives).

Hardware model (all times virtual seconds, nothing sleeps):
- a server decodes its running sequences together, one token each per step of a + b * batch
  seconds (fluid: progress is continuous between events); admitting a sequence costs a prefill of
  prompt_len / prefill_tps; after a weight update in-flight sequences keep their tokens and
  continue under the new version, first recomputing their KV cache (context / prefill_tps), as
  our engine does;
- an episode is a group of `group_size` sequences of iid capped-lognormal lengths, spread over the
  least-loaded servers; it is finished when its longest sequence is;
- a training step takes batch_tokens / (train_devices * train_tps), then the weight sync pauses
  every server for sync_s.
Placement COLOCATED (the synchronous baseline): every device generates, then every device trains;
SPLIT: `gen_fraction` of the devices serve, the rest train, and the two overlap.

Pure Python, deterministic for a seed (sync and async runs of one seed draw the same lengths).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, fields, replace
from enum import Enum

from asyncrl.rollout.staleness import StalenessManager


class Placement(str, Enum):
    COLOCATED = "colocated"  # all devices generate, then all train (generation idle meanwhile)
    SPLIT = "split"  # disjoint generation and training devices, running concurrently


class Refill(str, Enum):
    """When the trainer side tops the rollout queue up to max_concurrent_rollouts."""

    WHEN_SHORT = "when_short"  # the executor before this model found its cost: only while short
    EVERY_CALL = "every_call"  # WorkflowExecutor.prepare_batch now: every call, also when ready
    CONTINUOUS = "continuous"  # whenever not paused, training included

    def __str__(self) -> str:
        return self.value


_RANGES = {  # field: (low, high) inclusive; checked in SimConfig.__post_init__
    "eta": (0, 10**6), "devices": (1, 10**5), "gen_fraction": (0.0, 1.0),
    "batch_size": (1, 10**6), "group_size": (1, 10**4), "max_batch": (1, 10**5),
    "oversubscribe": (0.0, 1e3),
    "step_a": (0.0, 1e3), "step_b": (0.0, 1e3), "prefill_tps": (1.0, math.inf),
    "median_len": (1.0, 1e7), "sigma": (0.0, 10.0), "max_len": (1, 10**8),
    "prompt_len": (0, 10**8), "train_tps": (1e-9, math.inf), "sync_s": (0.0, 1e5),
    "steps": (1, 10**6), "warmup_steps": (0, 10**6),
}


@dataclass(frozen=True)
class SimConfig:
    eta: int = 0  # staleness bound; 0 = synchronous
    devices: int = 16  # total virtual GPUs, the same for every placement (equal hardware)
    placement: Placement | None = None  # None: COLOCATED if eta == 0 else SPLIT
    gen_fraction: float = 0.75  # SPLIT: share of devices that serve (at least 1 each side)
    batch_size: int = 128  # episodes (prompts) per training step
    group_size: int = 8  # sampled answers per prompt
    max_batch: int = 128  # concurrent sequences per server; more wait in a queue
    oversubscribe: float = 2.0  # max_concurrent_rollouts = this * server slots / group_size
    step_a: float = 0.010  # s per decode step, fixed part
    step_b: float = 1e-4  # s per decode step per running sequence
    prefill_tps: float = 50_000.0  # prompt prefill and post-update KV recompute, tokens/s
    median_len: float = 1000.0  # generated tokens, lognormal median
    sigma: float = 1.0  # lognormal sigma (tail heaviness)
    max_len: int = 16384  # generation cap
    prompt_len: int = 256
    train_tps: float = 8000.0  # trained tokens/s per training device
    sync_s: float = 3.0  # weight-sync pause per step
    steps: int = 16
    warmup_steps: int = 2  # excluded from the throughput window (pipeline fill)
    resample_on_drop: bool = True  # a dropped prompt draws new lengths (False: same lengths again)
    refill: Refill = Refill.EVERY_CALL
    seed: int = 0

    def __post_init__(self) -> None:
        for name, (lo, hi) in _RANGES.items():
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise ValueError(f"SimConfig.{name}={value} is out of range; allowed [{lo}, {hi}]")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"SimConfig.warmup_steps={self.warmup_steps} is out of range; "
                             f"allowed [0, steps - 1 = {self.steps - 1}]")
        if self.resolved_placement is Placement.SPLIT and self.devices < 2:
            raise ValueError(f"SimConfig.devices={self.devices} is out of range for a split "
                             "placement; allowed [2, inf)")

    @property
    def resolved_placement(self) -> Placement:
        if self.placement is not None:
            return Placement(self.placement)
        return Placement.COLOCATED if self.eta == 0 else Placement.SPLIT

    @property
    def gen_servers(self) -> int:
        if self.resolved_placement is Placement.COLOCATED:
            return self.devices
        return min(self.devices - 1, max(1, round(self.devices * self.gen_fraction)))

    @property
    def train_devices(self) -> int:
        if self.resolved_placement is Placement.COLOCATED:
            return self.devices
        return self.devices - self.gen_servers

    def step_time(self, batch: int) -> float:
        return self.step_a + self.step_b * batch


@dataclass
class SimResult:
    config: SimConfig
    gen_servers: int
    train_devices: int
    wall_s: float  # virtual time of the whole run
    window_s: float  # steady-state window: end of warm-up step to end of last step
    steps_per_hour: float  # in the window
    trained_tokens_per_s: float  # prompt + generated tokens of consumed trajectories, window
    gen_util: float  # generated tokens / what the serving devices could decode at full batch
    train_util: float  # share of the window the trainer computes
    staleness: list[int]  # version - start_version of every consumed trajectory
    stale_dropped: int
    wasted_token_share: float  # generated tokens thrown away with dropped trajectories
    consumed_mean_len: float  # mean generated length of trained sequences (shows length bias)
    overlap_tokens: float  # tokens generated while the trainer computed (0 for synchronous RL)
    max_running_at_train: int  # episodes running when a training step began

    @property
    def mean_staleness(self) -> float:
        return sum(self.staleness) / max(1, len(self.staleness))

    @property
    def max_staleness(self) -> int:
        return max(self.staleness, default=0)

    @property
    def drop_rate(self) -> float:
        return self.stale_dropped / max(1, len(self.staleness) + self.stale_dropped)


class _Episode:
    __slots__ = ("lengths", "remaining", "seq", "start_version")

    def __init__(self, lengths: tuple[int, ...], start_version: int, seq: int) -> None:
        self.lengths, self.start_version, self.seq = lengths, start_version, seq
        self.remaining = len(lengths)


class _Server:
    """Fluid decode model: `progress` = tokens each running sequence has gained so far."""

    __slots__ = ("active", "epoch", "last_t", "progress", "stall_until", "tokens")

    def __init__(self) -> None:
        self.progress = self.last_t = self.stall_until = self.tokens = 0.0
        self.active: list[tuple[float, int, _Episode, float]] = []  # (finish, seq, ep, start)
        self.epoch = 0  # bumped on every reschedule; older completion events are ignored

    def advance(self, t: float, cfg: SimConfig) -> None:
        n, start = len(self.active), max(self.last_t, self.stall_until)
        if n and t > start:
            gained = (t - start) / cfg.step_time(n)
            self.progress += gained
            self.tokens += gained * n
        self.last_t = t

    def context_tokens(self, prompt_len: int) -> float:
        return sum(prompt_len + self.progress - s for _, _, _, s in self.active)


_SEQ_DONE, _TRAIN_DONE, _SYNC_DONE = 0, 1, 2
_EPS = 1e-7


class _Sim:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.servers = [_Server() for _ in range(cfg.gen_servers)]
        self.loads = [0] * cfg.gen_servers  # len(server.active), kept for fast routing
        self.max_concurrent = max(1, int(cfg.oversubscribe * cfg.gen_servers * cfg.max_batch
                                         / cfg.group_size))
        self.manager = StalenessManager(self.max_concurrent, cfg.batch_size, cfg.eta)
        self.rng = random.Random(cfg.seed)
        self.seq = itertools.count()
        self.events: list[tuple[float, int, int, int, int]] = []  # (t, seq, kind, server, epoch)
        self.now, self.version, self.paused, self.training = 0.0, 0, False, False
        self.pending: deque[tuple[int, ...]] = deque()  # queued prompts (their lengths)
        self.ready: list[tuple[int, int, _Episode]] = []  # heap, oldest start version first
        self.overflow: deque[tuple[_Episode, int]] = deque()  # sequences no server had room for
        self.dirty: set[int] = set()
        self.staleness: list[int] = []
        self.step_ends: list[float] = []
        self.gen_at_step_end: list[float] = []
        self.tokens_per_step: list[int] = []
        self.train_time_per_step: list[float] = []
        self.wasted = self.consumed_gen = 0
        self.overlap = self.gen_at_train_start = 0.0
        self.max_running_at_train = 0

    # ---- producer side: the executor's pending queue and scheduler ------------------------

    def _draw(self) -> tuple[int, ...]:
        c, mu = self.cfg, math.log(self.cfg.median_len)
        return tuple(min(c.max_len, max(1, round(self.rng.lognormvariate(mu, c.sigma))))
                     for _ in range(c.group_size))

    def _top_up(self) -> None:  # prepare_batch: keep pending + running at max_concurrent
        want = self.max_concurrent - len(self.pending) - self.manager.stats.running
        self.pending.extend(self._draw() for _ in range(max(0, want)))

    def _schedule(self) -> None:  # WorkflowExecutor._scheduler for asynchronous submissions
        while self.pending and not self.paused and self.manager.capacity(self.version) > 0:
            self.manager.on_submit()
            ep = _Episode(self.pending.popleft(), self.version, next(self.seq))
            for length in ep.lengths:
                self._route(ep, length)

    def _route(self, ep: _Episode, length: int) -> None:
        least = min(self.loads)
        if least >= self.cfg.max_batch:
            self.overflow.append((ep, length))
        else:
            self._admit(self.loads.index(least), ep, length)

    def _admit(self, i: int, ep: _Episode, length: int) -> None:
        s = self.servers[i]
        s.advance(self.now, self.cfg)
        heapq.heappush(s.active, (s.progress + length, next(self.seq), ep, s.progress))
        self.loads[i] += 1
        s.stall_until = max(s.stall_until, self.now) + self.cfg.prompt_len / self.cfg.prefill_tps
        self.dirty.add(i)

    def _reschedule(self, i: int) -> None:
        s = self.servers[i]
        s.epoch += 1
        if s.active:
            start = max(self.now, s.stall_until)
            t = start + (s.active[0][0] - s.progress) * self.cfg.step_time(len(s.active))
            heapq.heappush(self.events, (t, next(self.seq), _SEQ_DONE, i, s.epoch))

    def _on_seq_done(self, i: int, epoch: int) -> None:
        s = self.servers[i]
        if epoch != s.epoch:
            return
        s.advance(self.now, self.cfg)
        while s.active and s.active[0][0] <= s.progress + _EPS:
            ep = heapq.heappop(s.active)[2]
            self.loads[i] -= 1
            ep.remaining -= 1
            if ep.remaining == 0:
                self.manager.on_accept()
                heapq.heappush(self.ready, (ep.start_version, ep.seq, ep))
        while self.overflow and len(s.active) < self.cfg.max_batch:
            self._admit(i, *self.overflow.popleft())
        self.dirty.add(i)

    # ---- consumer side: the trainer loop --------------------------------------------------

    def _drop_stale(self) -> None:  # WorkflowExecutor._drop_stale
        while self.ready and self.manager.is_too_stale(self.ready[0][0], self.version):
            ep = heapq.heappop(self.ready)[2]
            self.manager.on_stale_drop()
            self.wasted += sum(ep.lengths)
            self.pending.appendleft(self._draw() if self.cfg.resample_on_drop else ep.lengths)

    def _trainer_poll(self) -> None:
        if self.training or self.paused or len(self.step_ends) == self.cfg.steps:
            return
        self._drop_stale()
        if self.cfg.refill is not Refill.WHEN_SHORT:
            self._top_up()
        if len(self.ready) < self.cfg.batch_size:
            self._top_up()
            return
        batch = [heapq.heappop(self.ready)[2] for _ in range(self.cfg.batch_size)]
        gen = 0
        for ep in batch:
            self.manager.on_consume(ep.start_version, self.version)
            self.staleness.append(self.version - ep.start_version)
            gen += sum(ep.lengths)
        self.consumed_gen += gen
        tokens = gen + self.cfg.prompt_len * self.cfg.group_size * len(batch)
        duration = tokens / (self.cfg.train_devices * self.cfg.train_tps)
        self.tokens_per_step.append(tokens)
        self.train_time_per_step.append(duration)
        self.max_running_at_train = max(self.max_running_at_train, self.manager.stats.running)
        self.gen_at_train_start = self._generated()
        if self.cfg.resolved_placement is Placement.COLOCATED:  # the devices are training
            self._stall_all(self.now + duration)
        self.training = True
        self._push(self.now + duration, _TRAIN_DONE)

    def _on_train_done(self) -> None:
        self.training, self.paused = False, True  # executor.pause(); engines interrupted
        self.overlap += self._generated() - self.gen_at_train_start
        end = self.now + self.cfg.sync_s
        for i, s in enumerate(self.servers):  # in-flight sequences recompute KV after the update
            s.advance(self.now, self.cfg)
            s.stall_until = max(s.stall_until, end) + (
                s.context_tokens(self.cfg.prompt_len) / self.cfg.prefill_tps)
            self.dirty.add(i)
        self._push(end, _SYNC_DONE)

    def _on_sync_done(self) -> None:
        self.version += 1  # set_version(); resume()
        self.paused = False
        self.step_ends.append(self.now)
        self.gen_at_step_end.append(self._generated())

    # ---- event loop -----------------------------------------------------------------------

    def _push(self, t: float, kind: int) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, -1, 0))

    def _stall_all(self, until: float) -> None:
        for i, s in enumerate(self.servers):
            s.advance(self.now, self.cfg)
            s.stall_until = max(s.stall_until, until)
            self.dirty.add(i)

    def _generated(self) -> float:
        for s in self.servers:
            s.advance(self.now, self.cfg)
        return sum(s.tokens for s in self.servers)

    def run(self) -> SimResult:
        cfg = self.cfg
        self._trainer_poll()
        while len(self.step_ends) < cfg.steps:
            self._schedule()
            for i in self.dirty:
                self._reschedule(i)
            self.dirty.clear()
            if not self.events:
                raise RuntimeError(f"simulation stalled at t={self.now:.1f}s, version "
                                   f"{self.version}: {self.manager.stats}")
            self.now, _, kind, server, epoch = heapq.heappop(self.events)
            if kind == _SEQ_DONE:
                self._on_seq_done(server, epoch)
            elif kind == _TRAIN_DONE:
                self._on_train_done()
            else:
                self._on_sync_done()
            self._trainer_poll()
            if self.cfg.refill is Refill.CONTINUOUS and not self.paused:
                self._top_up()
        return self._result()

    def _result(self) -> SimResult:
        cfg = self.cfg
        w = cfg.warmup_steps
        t0 = self.step_ends[w - 1] if w else 0.0
        window = self.step_ends[-1] - t0
        gen0 = self.gen_at_step_end[w - 1] if w else 0.0
        peak = len(self.servers) * cfg.max_batch / cfg.step_time(cfg.max_batch)
        if max(self.staleness) > cfg.eta:  # the bound this whole design exists to keep
            raise AssertionError(f"consumed staleness {max(self.staleness)} > eta={cfg.eta}")
        return SimResult(
            config=cfg, gen_servers=cfg.gen_servers, train_devices=cfg.train_devices,
            wall_s=self.step_ends[-1], window_s=window,
            steps_per_hour=3600.0 * (cfg.steps - w) / window,
            trained_tokens_per_s=sum(self.tokens_per_step[w:]) / window,
            gen_util=(self.gen_at_step_end[-1] - gen0) / (peak * window),
            train_util=sum(self.train_time_per_step[w:]) / window,
            staleness=self.staleness, stale_dropped=self.manager.stats.stale_dropped,
            wasted_token_share=self.wasted / max(1.0, self._generated()),
            consumed_mean_len=self.consumed_gen / (len(self.staleness) * cfg.group_size),
            overlap_tokens=self.overlap, max_running_at_train=self.max_running_at_train)


def simulate(cfg: SimConfig) -> SimResult:
    """Run one configuration; raises AssertionError if consumed staleness ever exceeds eta."""
    return _Sim(cfg).run()


def split_candidates(cfg: SimConfig, fractions: list[float]) -> list[SimConfig]:
    """One config per distinct generation/training device split among `fractions`."""
    seen, out = set(), []
    for f in fractions:
        c = replace(cfg, gen_fraction=f)
        if c.gen_servers not in seen:
            seen.add(c.gen_servers)
            out.append(c)
    return out


def best_of(results: list[SimResult]) -> SimResult:
    """The run with the most training steps per hour (ties: fewer serving devices)."""
    return max(results, key=lambda r: (r.steps_per_hour, -r.gen_servers))


CONFIG_FIELDS = tuple(f.name for f in fields(SimConfig))
