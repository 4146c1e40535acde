"""The loop of one training run, handed its parts built (launch/train.py builds them):

    batch = prepare_batch()            oldest first, never staler than eta; the watchdog stops a
                                       run that cannot form one (launch/watchdog.py)
    trainer.train_step(batch)          [ref logprobs] -> [proximal] -> advantages -> PPO
    push weights, version + 1          in-flight sequences continue under new weights; canary
    eval every K / checkpoint every K  a checkpoint suspends the episodes in flight and keeps them
    log, plot, progress

Every wait on the rollout side's event loop (weight push, evaluation) is bounded (`bounded`): past
its limit the coroutine is cancelled and the run ends with an error naming it. Ctrl-C (or
SIGTERM) asks the loop to stop after the current step (`StopRequest`): it writes a checkpoint and
returns; a second Ctrl-C stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.api import Closable, Evaluator, ReportsMetrics
from asyncrl.launch.data_stream import DataStream
from asyncrl.launch.eval_grid import GRID_FILE, INITIAL_GRID_FILE, save_eval_grid
from asyncrl.launch.progress import TrainProgress
from asyncrl.launch.rollout_engines import RolloutEngines
from asyncrl.launch.rollout_monitor import RolloutMonitor, batch_metrics
from asyncrl.launch.run_checkpoints import LoopState, RunCheckpointer
from asyncrl.launch.run_events import EventKind, RunEvents
from asyncrl.launch.run_logger import RunLogger
from asyncrl.launch.step_samples import StepSamples
from asyncrl.launch.train_config import TrainRunConfig
from asyncrl.launch.trainer_group import TrainerGroup
from asyncrl.launch.watchdog import NoProgressError, Watchdog
from asyncrl.rollout.executor import RunTimeout, WorkflowExecutor


logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What `Trainer.train` returns: the run directory, the policy updates done, training and
    wall seconds, the evaluation scores (the first, the last, and (step, training seconds,
    score) per evaluation; None without evaluations) and why the run stopped: "total_steps",
    "max_train_seconds" or "interrupted". A trainer rank other than the first gets only
    `run_dir`."""

    run_dir: Path
    steps: int = 0
    train_seconds: float = 0.0
    wall_seconds: float = 0.0
    initial_accuracy: float | None = None
    final_accuracy: float | None = None
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # step, train s, acc
    stopped_by: str = "total_steps"


class StopRequest:
    """First SIGINT/SIGTERM: finish the step, checkpoint, exit. Second: KeyboardInterrupt now."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def bounded(executor: WorkflowExecutor, coro: Any, limit: float, what: str, setting: str
             ) -> Any:
    """Run `coro` on the executor's loop; past `limit` seconds cancel it and raise an error
    naming the wait and its setting."""
    try:
        return executor.run(coro, timeout=limit)
    except RunTimeout:
        raise Watchdog.timed_out(what, setting, limit, f"rollouts: {executor.stats()}") from None


@dataclass(frozen=True)
class LoopParts:
    """The built parts a run's loop drives."""

    trainer: TrainerGroup
    engines: RolloutEngines
    executor: WorkflowExecutor
    evaluator: Evaluator
    stream: DataStream
    monitor: RolloutMonitor  # the executor's accept rule, and the rollout numbers it counts
    checkpointer: RunCheckpointer
    logger: RunLogger
    progress: TrainProgress
    stop: StopRequest
    events: RunEvents  # RUN/events.jsonl: evaluations, checkpoints, warnings, the stop
    samples: StepSamples  # RUN/samples/: a few groups of each batch, token by token
    reporters: tuple[ReportsMetrics, ...] = ()  # log their metrics() after every step
    closables: tuple[Closable, ...] = ()  # closed on the executor's loop when the loop ends


@dataclass(frozen=True)
class RunContext:
    cfg: TrainRunConfig
    run_dir: Path
    eval_rows: list[dict[str, Any]]
    state: LoopState  # the loop's counters, registered with the checkpointer


class TrainLoop:
    """`run` is the loop of the module docstring; it returns the run's result."""

    def __init__(self, parts: LoopParts, ctx: RunContext) -> None:
        self.parts, self.ctx, self.cfg, self.state = parts, ctx, ctx.cfg, ctx.state
        self.watchdog = Watchdog(self.cfg.watchdog)
        self.result = TrainResult(ctx.run_dir)
        # (when, the executor's idle seconds then): the start of the next step's idle share
        self._idle_mark = (time.perf_counter(), parts.executor.idle_seconds)
        self._engine_idle_mark = self._engine_idle()
        self._evaluated_at = -1  # the step of the last evaluation

    def run(self) -> TrainResult:
        try:
            self._run()
        except BaseException as err:
            self.parts.events.emit(EventKind.ERROR, f"the run stopped at step "
                                   f"{self.state.step}: {type(err).__name__}: {err}")
            raise
        finally:  # e.g. an agent workflow's proxy server and process pool
            for part in self.parts.closables:
                self.parts.executor.run(part.aclose(), timeout=60)
        return self.result

    def _run(self) -> None:
        cfg, state, p = self.cfg, self.state, self.parts
        wall0 = time.perf_counter() - state.wall_seconds
        if state.step == 0 and cfg.eval.enabled:
            self.evaluate_and_log(initial=True)
        stopped_by = "total_steps"
        while state.step < cfg.total_steps:
            if cfg.max_train_seconds is not None and state.train_seconds >= cfg.max_train_seconds:
                stopped_by = "max_train_seconds"
                break
            if p.stop.requested:
                stopped_by = "interrupted"
                break
            t0 = time.perf_counter()
            try:
                metrics = self.train_one_step()
            except NoProgressError:
                self.finish("no_progress", wall0)  # checkpoint what was trained, then say why
                raise
            if isinstance(metrics, str):
                stopped_by = metrics
                break
            state.train_seconds += time.perf_counter() - t0
            state.wall_seconds = time.perf_counter() - wall0
            p.events.step = state.step
            metrics.update({"time/elapsed_s": state.train_seconds,
                            "time/wall_s": state.wall_seconds})
            if self.eval_due():
                metrics.update(self.evaluate_and_log())
            p.logger.log(state.step, metrics)
            p.progress.update(state.step, metrics)
            if cfg.logging.plot and state.step % cfg.logging.plot_every == 0:
                p.logger.plot()
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
                self.checkpoint(final=False)
        self.finish(stopped_by, wall0)

    def finish(self, stopped_by: str, wall0: float) -> None:
        cfg, state, p = self.cfg, self.state, self.parts
        if cfg.eval.enabled and state.step > 0 and self._evaluated_at != state.step:
            metrics = self.evaluate_and_log()
            metrics.update({"time/elapsed_s": state.train_seconds,
                            "policy/version": float(p.trainer.trainer.version.value)})
            p.logger.log(state.step, metrics, force=True)
        state.wall_seconds = time.perf_counter() - wall0
        if state.step > 0 and not (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0):
            self.checkpoint(final=True)
        if cfg.logging.plot:
            p.logger.plot()
        self.result.steps, self.result.stopped_by = state.step, stopped_by
        self.result.train_seconds, self.result.wall_seconds = state.train_seconds, state.wall_seconds
        p.progress.message(f"stopped by {stopped_by} at step {state.step} after "
                           f"{state.train_seconds:.0f}s of training "
                           f"({state.wall_seconds:.0f}s wall); run dir {self.ctx.run_dir}")
        p.events.emit(EventKind.STOP, f"stopped by {stopped_by} at step {state.step} after "
                      f"{state.train_seconds:.0f}s of training", stopped_by=stopped_by,
                      train_seconds=state.train_seconds)

    def next_batch(self) -> list | str:
        """The next batch, or why the loop stops while waiting for it: "interrupted" (a stop
        was requested) or "max_train_seconds" (the time budget counts waiting too). A run that
        cannot form one ends with NoProgressError (launch/watchdog.py)."""
        t0, budget, p = time.perf_counter(), self.cfg.max_train_seconds, self.parts
        while True:
            try:
                return p.executor.prepare_batch(p.stream, timeout=0.5)
            except TimeoutError:
                waited = time.perf_counter() - t0
                if p.stop.requested:
                    return "interrupted"
                if budget is not None and self.state.train_seconds + waited >= budget:
                    self.state.train_seconds += waited
                    return "max_train_seconds"
                self.watchdog.check(p.executor.stats(), waited, self.state.step)

    def train_one_step(self) -> dict[str, float] | str:
        p = self.parts
        t0 = time.perf_counter()
        trajs = self.next_batch()
        if isinstance(trajs, str):
            return trajs
        t1 = time.perf_counter()
        version = p.trainer.trainer.version
        metrics = batch_metrics(trajs, version.value)
        self._warn_if_cut(metrics["batch/truncated_frac"])
        metrics.update(p.trainer.train_step(trajs))  # advances the trainer's version
        t2 = time.perf_counter()
        new_version = version.value
        # the engines serve it when this returns; the executor follows `engines.version`
        metrics.update(bounded(p.executor, p.engines.push(p.trainer.state_dict(), new_version),
                               self.cfg.watchdog.sync_timeout_s,
                               f"the weight push to version {new_version}",
                               "watchdog.sync_timeout_s"))
        t3 = time.perf_counter()
        idle, self._idle_mark = self._idle_mark, (t3, p.executor.idle_seconds)
        engine_idle, self._engine_idle_mark = self._engine_idle_mark, self._engine_idle()
        self.state.step += 1
        p.samples.write(self.state.step, new_version - 1, trajs,
                        p.trainer.actor.take_record())
        metrics.update(p.monitor.take())
        for reporter in p.reporters:
            metrics.update(reporter.metrics())
        stats = p.executor.stats()
        metrics.update({
            "policy/version": float(new_version),
            "perf/wait_s": t1 - t0, "perf/train_s": t2 - t1, "perf/weight_sync_s": t3 - t2,
            # share of the time since the previous step in which no rollout ran
            "perf/rollout_idle_frac": (self._idle_mark[1] - idle[1]) / max(t3 - idle[0], 1e-9),
            "perf/train_tokens_per_s": metrics["batch/tokens"] / max(t2 - t1, 1e-9),
            **({} if engine_idle is None else {  # in-process engine: nothing to generate
                "perf/engine_idle_frac": (self._engine_idle_mark - engine_idle)
                / max(t3 - idle[0], 1e-9)}),
            "rollout/stale_dropped": float(stats["stale_dropped"]),
            "rollout/failed": float(stats["failed"]),
            "rollout/running": float(stats["running"]),
            "rollout/rejected_in_a_row": float(stats["rejected_in_a_row"]),
        })
        # the episodes a checkpoint brought back: what became of each (consumed, dropped, ...)
        metrics.update({f"rollout/restored_{k}": float(v) for k, v in stats["restored"].items()})
        return metrics

    def _warn_if_cut(self, frac: float) -> None:
        """One warning (an event in events.jsonl too) for a step most of whose completions ran
        into the generation limit: answers cut short score as wrong ones."""
        if frac > 0.5:
            logger.warning(
                "%.0f%% of step %d's completions were cut at gconfig.max_new_tokens=%d before "
                "the model ended them; raise gconfig.max_new_tokens (or the model's context) if "
                "its answers need more room", 100 * frac, self.state.step + 1,
                self.cfg.gconfig.max_new_tokens)

    def _engine_idle(self) -> float | None:
        """The in-process engine's idle seconds so far (None for servers: not known here)."""
        return getattr(self.parts.engines.engine, "idle_seconds", None)

    def eval_due(self) -> bool:
        """After a step: `eval.every` steps, or `eval.every_s` training seconds since the last
        evaluation (the start's, or none yet: 0 s)."""
        ev, state = self.cfg.eval, self.state
        if ev.every and state.step % ev.every == 0:
            return True
        last = self.result.evals[-1][1] if self.result.evals else 0.0
        return ev.every_s is not None and state.train_seconds - last >= ev.every_s

    def evaluate_and_log(self, initial: bool = False) -> dict[str, float]:
        p = self.parts
        self._evaluated_at = self.state.step
        t0 = time.perf_counter()
        held = self._suspend_rollouts() if self.cfg.eval.pause_rollouts else None
        try:
            report = bounded(p.executor,
                             p.evaluator.aevaluate(p.engines.engine, self.ctx.eval_rows),
                             self.cfg.watchdog.eval_timeout_s, "the evaluation",
                             "watchdog.eval_timeout_s")
        finally:
            if held is not None:
                p.executor.restore(held)
                p.executor.resume()
        metrics, acc = dict(report.metrics), report.score
        step = self.state.step
        self.result.evals.append((step, self.state.train_seconds, acc))
        if initial:
            self.result.initial_accuracy = acc
            p.logger.log(0, {**metrics, "time/elapsed_s": 0.0, "policy/version": 0.0},
                         force=True)
        self.result.final_accuracy = acc
        self._save_grid(report, initial)
        p.progress.message(f"eval at step {step}: {report.name} {acc:.3g}{report.detail} "
                           f"({len(self.ctx.eval_rows)} held-out problems, "
                           f"{time.perf_counter() - t0:.1f}s)")
        p.events.emit(EventKind.EVAL, f"{report.name} {acc:.3g}{report.detail} on "
                      f"{len(self.ctx.eval_rows)} held-out problems", metric=report.name,
                      score=acc)
        return metrics

    def _suspend_rollouts(self) -> Any:
        """eval.pause_rollouts: the training episodes in flight, taken out for the evaluation
        (their generations interrupted and journaled; one still waiting after a second, on a
        tool, is restarted from its row); the engines serve the evaluation meanwhile."""
        p = self.parts
        snap = p.executor.suspend(p.engines.interrupt, timeout=1.0)
        p.engines.resume()
        return snap

    def _save_grid(self, report: Any, initial: bool) -> None:
        """The eval rows with images, drawn with the model's answers (launch/eval_grid.py)."""
        if not report.answers:
            return
        title = f"step {self.state.step}: {report.name} {report.score:.3g}"
        for name in (INITIAL_GRID_FILE, GRID_FILE) if initial else (GRID_FILE,):
            save_eval_grid(self.ctx.run_dir / name, self.ctx.eval_rows, report.answers, title)

    def checkpoint(self, final: bool) -> None:
        """Suspend the episodes in flight, save every registered part (the episodes with the
        executor's state), then (unless `final`) put them back: they continue from the tokens
        they had."""
        p = self.parts
        snap = p.executor.suspend(p.engines.interrupt, self.cfg.watchdog.suspend_timeout_s)
        try:
            path = p.trainer.checkpoint(p.checkpointer, self.state.step)
        finally:
            if not final:
                p.executor.restore(snap)
                p.engines.resume()
                p.executor.resume()
        kept = ", ".join(f"{v} {k}" for k, v in snap.counts().items())
        p.progress.message(f"checkpoint {path} (episodes in flight kept: {kept})")
        p.events.emit(EventKind.CHECKPOINT, f"checkpoint {path.name} (episodes in flight kept: "
                      f"{kept})", path=str(path), episodes=snap.counts())
