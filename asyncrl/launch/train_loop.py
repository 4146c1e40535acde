"""The loop of one training run (`Trainer` builds its parts, launch/train.py):

    batch = prepare_batch()            oldest first, never staler than eta; the watchdog stops a
                                       run that cannot form one (launch/watchdog.py)
    actor.train_step(batch)            [ref logprobs] -> [proximal] -> advantages -> PPO
    push weights, version + 1          in-flight sequences continue under new weights; canary
    eval every K / checkpoint every K  a checkpoint suspends the episodes in flight and keeps them
    log, plot, progress

Every wait on the rollout side's event loop (weight push, evaluation, start-up checks) is bounded
(`bounded`): past its limit the coroutine is cancelled and the run ends with an error naming it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from asyncrl.api import Evaluator, ReportsMetrics, RolloutWorkflow
from asyncrl.launch.data_stream import DataStream
from asyncrl.launch.progress import TrainProgress
from asyncrl.launch.rollout_engines import RolloutEngines
from asyncrl.launch.rollout_monitor import RolloutMonitor, batch_metrics
from asyncrl.launch.run_checkpoints import LoopState, load_rollouts
from asyncrl.launch.run_logger import RunLogger
from asyncrl.launch.trainer_group import TrainerGroup
from asyncrl.launch.watchdog import NoProgressError, Watchdog
from asyncrl.rollout.executor import RunTimeout, WorkflowExecutor

if TYPE_CHECKING:
    from asyncrl.launch.train import StopRequest, Trainer


def bounded(executor: WorkflowExecutor, coro: Any, limit: float, what: str, setting: str
             ) -> Any:
    """Run `coro` on the executor's loop; past `limit` seconds cancel it and raise an error
    naming the wait and its setting."""
    try:
        return executor.run(coro, timeout=limit)
    except RunTimeout:
        raise Watchdog.timed_out(what, setting, limit, f"rollouts: {executor.stats()}") from None


class TrainLoop:
    """One run's mutable state; `run` is the loop of the module docstring."""

    def __init__(self, job: Trainer, state: LoopState, tokenizer: Any,
                 workflow: RolloutWorkflow, evaluator: Evaluator, engines: RolloutEngines,
                 group: TrainerGroup, executor: WorkflowExecutor, stream: DataStream,
                 logger: RunLogger, progress: TrainProgress, stop: StopRequest,
                 reward: Any = None) -> None:
        self.job, self.cfg, self.state = job, job.cfg, state
        self.tokenizer, self.engines = tokenizer, engines
        self.workflow, self.evaluator = workflow, evaluator
        # what reports metrics after each step: the workflow, the reward (a judge's counts)
        self.reporters = [r for r in (workflow, reward) if isinstance(r, ReportsMetrics)]
        self.group, self.trainer, self.executor = group, group.trainer, executor
        self.stream, self.logger, self.progress, self.stop = stream, logger, progress, stop
        self.monitor = RolloutMonitor(self.cfg.filter_uniform_groups)
        self.watchdog = Watchdog(self.cfg.watchdog)
        self.result = job.result
        if job.resume and job.ckpt is not None:  # the episodes that were in flight continue
            snap = load_rollouts(job.ckpt)
            if snap is not None:
                executor.restore(snap, workflow, self.monitor.accept)

    def run(self) -> None:
        try:
            self._run()
        finally:  # e.g. an agent workflow's proxy server and process pool
            close = getattr(self.workflow, "aclose", None)
            if close is not None:
                self.executor.run(close(), timeout=60)

    def _run(self) -> None:
        cfg, state = self.cfg, self.state
        wall0 = time.perf_counter() - state.wall_seconds
        if state.step == 0 and cfg.eval.every:
            self.evaluate_and_log(initial=True)
        stopped_by = "total_steps"
        while state.step < cfg.total_steps:
            if cfg.max_train_seconds is not None and state.train_seconds >= cfg.max_train_seconds:
                stopped_by = "max_train_seconds"
                break
            if self.stop.requested:
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
            metrics.update({"time/elapsed_s": state.train_seconds,
                            "time/wall_s": state.wall_seconds})
            if cfg.eval.every and state.step % cfg.eval.every == 0:
                metrics.update(self.evaluate_and_log())
            self.logger.log(state.step, metrics)
            self.progress.update(state.step, metrics)
            if cfg.logging.plot and state.step % cfg.logging.plot_every == 0:
                self.logger.plot()
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
                self.checkpoint(final=False)
        self.finish(stopped_by, wall0)

    def finish(self, stopped_by: str, wall0: float) -> None:
        cfg, state = self.cfg, self.state
        if cfg.eval.every and state.step % cfg.eval.every and state.step > 0:
            metrics = self.evaluate_and_log()
            metrics.update({"time/elapsed_s": state.train_seconds,
                            "policy/version": float(self.trainer.version.value)})
            self.logger.log(state.step, metrics, force=True)
        state.wall_seconds = time.perf_counter() - wall0
        if state.step > 0 and not (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0):
            self.checkpoint(final=True)
        if cfg.logging.plot:
            self.logger.plot()
        self.result.steps, self.result.stopped_by = state.step, stopped_by
        self.result.train_seconds, self.result.wall_seconds = state.train_seconds, state.wall_seconds
        self.progress.message(f"stopped by {stopped_by} at step {state.step} after "
                              f"{state.train_seconds:.0f}s of training "
                              f"({state.wall_seconds:.0f}s wall); run dir {self.job.run_dir}")

    def next_batch(self) -> list | str:
        """The next batch, or why the loop stops while waiting for it: "interrupted" (a stop
        was requested) or "max_train_seconds" (the time budget counts waiting too). A run that
        cannot form one ends with NoProgressError (launch/watchdog.py)."""
        t0, budget = time.perf_counter(), self.cfg.max_train_seconds
        while True:
            try:
                return self.executor.prepare_batch(self.stream, self.workflow,
                                                   self.monitor.accept, timeout=0.5)
            except TimeoutError:
                waited = time.perf_counter() - t0
                if self.stop.requested:
                    return "interrupted"
                if budget is not None and self.state.train_seconds + waited >= budget:
                    self.state.train_seconds += waited
                    return "max_train_seconds"
                self.watchdog.check(self.executor.stats(), waited, self.state.step)

    def train_one_step(self) -> dict[str, float] | str:
        t0 = time.perf_counter()
        trajs = self.next_batch()
        if isinstance(trajs, str):
            return trajs
        t1 = time.perf_counter()
        metrics = batch_metrics(trajs, self.trainer.version.value)
        metrics.update(self.group.train_step(trajs))  # advances the trainer's version
        t2 = time.perf_counter()
        new_version = self.trainer.version.value
        # the engines serve it when this returns; the executor follows `engines.version`
        metrics.update(bounded(self.executor, self.engines.push(
            self.group.state_dict(), new_version, self.trainer.model.config, self.tokenizer),
            self.cfg.watchdog.sync_timeout_s, f"the weight push to version {new_version}",
            "watchdog.sync_timeout_s"))
        t3 = time.perf_counter()
        self.state.step += 1
        self.state.data_position = self.stream.position
        metrics.update(self.monitor.take())
        for reporter in self.reporters:
            metrics.update(reporter.metrics())
        stats = self.executor.stats()
        metrics.update({
            "policy/version": float(new_version),
            "perf/wait_s": t1 - t0, "perf/train_s": t2 - t1, "perf/weight_sync_s": t3 - t2,
            "perf/train_tokens_per_s": metrics["batch/tokens"] / max(t2 - t1, 1e-9),
            "rollout/stale_dropped": float(stats["stale_dropped"]),
            "rollout/failed": float(stats["failed"]),
            "rollout/running": float(stats["running"]),
            "rollout/rejected_in_a_row": float(stats["rejected_in_a_row"]),
        })
        # the episodes a checkpoint brought back: what became of each (consumed, dropped, ...)
        metrics.update({f"rollout/restored_{k}": float(v) for k, v in stats["restored"].items()})
        return metrics

    def evaluate_and_log(self, initial: bool = False) -> dict[str, float]:
        t0 = time.perf_counter()
        report = bounded(self.executor, self.evaluator.aevaluate(self.engines.engine,
                                                                  self.job.eval_rows),
                          self.cfg.watchdog.eval_timeout_s, "the evaluation",
                          "watchdog.eval_timeout_s")
        metrics, acc = dict(report.metrics), report.score
        step = self.state.step
        self.result.evals.append((step, self.state.train_seconds, acc))
        if initial:
            self.result.initial_accuracy = acc
            self.logger.log(0, {**metrics, "time/elapsed_s": 0.0, "policy/version": 0.0},
                            force=True)
        self.result.final_accuracy = acc
        self.progress.message(f"eval at step {step}: {report.name} {acc:.3g}{report.detail} "
                              f"({len(self.job.eval_rows)} held-out problems, "
                              f"{time.perf_counter() - t0:.1f}s)")
        return metrics

    def checkpoint(self, final: bool) -> None:
        """Suspend the episodes in flight, save them with the trainer and the loop's state,
        then (unless `final`) put them back: they continue from the tokens they had."""
        snap = self.executor.suspend(self.engines.interrupt, self.cfg.watchdog.suspend_timeout_s)
        try:
            self.state.data_position = self.stream.position
            self.state.rollout = self.executor.state_dict()
            self.state.in_flight = snap.counts()
            path = self.group.checkpoint(self.job.run_dir, self.state, keep=3, rollouts=snap,
                                         shard_size=self.cfg.checkpoint_shard_size)
        finally:
            if not final:
                self.executor.restore(snap, self.workflow, self.monitor.accept)
                self.engines.resume()
                self.executor.resume()
        kept = ", ".join(f"{v} {k}" for k, v in snap.counts().items())
        self.progress.message(f"checkpoint {path} (episodes in flight kept: {kept})")
