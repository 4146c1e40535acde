"""`asyncrl train` and `Trainer`: the asynchronous GRPO/PPO loop, end to end.

    Trainer(config).train(workflow=..., eval_workflow=..., loss=...)
    engines generate continuously (executor, staleness bound eta)
    loop:  batch = prepare_batch()            oldest first, never staler than eta
           actor.train_step(batch)            [ref logprobs] -> [proximal] -> advantages -> PPO
           push weights, version + 1          in-flight sequences continue under new weights
           eval every K / checkpoint every K / log, plot, progress

The workflow is anything `launch/workflows.py` resolves (a RolloutWorkflow, an agent, a reward
function, a dotted path, or the config's); the loop only talks to it through protocols: its
episodes, its `aevaluate` (api.Evaluator), its `metrics()` (api.ReportsMetrics) and `aclose`.

Ctrl-C (or SIGTERM) asks the loop to stop after the current step: it writes a checkpoint and
shuts everything down (server processes included); a second Ctrl-C stops at once. `--resume RUN`
continues from the run's latest checkpoint: weights, optimizer, LR schedule, RNG, policy version,
data position, staleness counters, elapsed time, the metrics curve, and the episodes that were in
flight (every checkpoint suspends them and keeps their rows, unconsumed trajectories and partial
generations; they continue from the tokens they had). A run that cannot form a batch stops with
an error saying why (launch/watchdog.py); every wait of the loop has a time limit.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from asyncrl.api import PolicyLoss
from asyncrl.inference.backend_protocol import LoraServing
from asyncrl.launch.data_stream import DataStream
from asyncrl.launch.progress import TrainProgress
from asyncrl.launch.devices import check_engine_placement
from asyncrl.launch.devices import resolve as resolve_device
from asyncrl.launch.ray_trainer import RANK_ENV, run_on_ray
from asyncrl.launch.rollout_engines import AdapterSpec, open_rollout_engines
from asyncrl.launch.run_checkpoints import (CRITIC, TRAINER, LoopState, latest_checkpoint,
                                            load_loop_state)
from asyncrl.launch.run_logger import RunLogger
from asyncrl.launch.train_config import CONFIG_FILE, TrainRunConfig
from asyncrl.launch.train_loop import TrainLoop, bounded
from asyncrl.launch.trainer_group import (
    TrainerGroup,
    broadcast,
    is_distributed,
    leave_process_group,
    load_critic,
    load_engine,
    rank,
)
from asyncrl.launch.weight_check import LogprobCheck
from asyncrl.launch.workflows import (WorkflowContext, resolve_evaluator, resolve_loss,
                                      resolve_workflow)
from asyncrl.models.loading import load_tokenizer, resolve_model_dir
from asyncrl.launch.judge_engine import open_run_reward
from asyncrl.rollout.executor import WorkflowExecutor
from asyncrl.train.lora import peft_config_dict
from asyncrl.train.config import lora_enabled



@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    train_seconds: float
    wall_seconds: float
    initial_accuracy: float | None
    final_accuracy: float | None
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


def default_run_dir() -> Path:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / stamp


def resolve_base_model(cfg: TrainRunConfig, console: Console) -> Path:
    """The base model's directory: `model.path` (a hub id resolved once, here, to its cached
    snapshot, so trainer, critic, reference and engines all read the same files), else the
    SFT warm start of the tiny model."""
    if cfg.model.path:
        return resolve_model_dir(cfg.model)
    from asyncrl.launch.sft import run_sft_job

    rl = (f"{cfg.max_train_seconds / 60:.0f} min of RL training"
          if cfg.max_train_seconds is not None else f"{cfg.total_steps} RL steps")
    extra = f", plus evaluations every {cfg.eval.every} steps" if cfg.eval.every else ""
    return Path(run_sft_job(cfg.warm_start, console, then=(rl + extra,
                                                          cfg.max_train_seconds)).model_dir)


@contextlib.contextmanager
def trainer_threads(cfg: TrainRunConfig) -> Iterator[None]:
    """The trainer (and the SFT warm start) use every core of their rank by default; the
    caller's count is restored after. An in-process engine runs its kernels with
    `inference.engine.num_threads` on its own thread: it generates in short bursts (on the main job
    ~0.25 s per 128 samples against ~0.5 s of training), so reserving it a core would leave
    that core idle most of the step."""
    before = torch.get_num_threads()
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by torchrun
    torch.set_num_threads(cfg.torch_threads or max(1, (os.cpu_count() or 1) // ranks_here))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class _Plugins:
    """What the caller of `train` passed (objects or dotted paths; None: the config's)."""

    workflow: Any = None
    workflow_kwargs: dict[str, Any] | None = None
    eval_workflow: Any = None
    loss: Any = None


class Trainer:
    """The asynchronous RL trainer: `Trainer(config).train(workflow=...)`.

    `config`: a TrainRunConfig, a YAML path, or a dict of its fields (with `overrides`, dotted
    `key=value` strings, on top). `run_dir`: where logs, checkpoints and the resolved config go
    (default: `config.output_dir`, else runs/<UTC timestamp>).
    """

    def __init__(self, config: TrainRunConfig | str | Path | dict[str, Any], *,
                 run_dir: str | Path | None = None, console: Console | None = None,
                 overrides: list[str] | tuple[str, ...] = ()) -> None:
        if isinstance(config, (str, Path)):
            config = TrainRunConfig.load(str(config), list(overrides))
        elif isinstance(config, dict):
            config = TrainRunConfig.from_dict(config)
        elif overrides:
            config = TrainRunConfig.from_dict(_with_overrides(config.to_dict(), overrides))
        self.cfg = config
        self.run_dir = Path(run_dir) if run_dir is not None else (
            Path(config.output_dir) if config.output_dir else default_run_dir())
        self.console = console or Console(stderr=True)
        self.resume = False
        self.plugins = _Plugins()
        self.result = TrainResult(self.run_dir, 0, 0.0, 0.0, None, None)

    def train(self, workflow: Any = None, *, eval_workflow: Any = None, loss: Any = None,
              workflow_kwargs: dict[str, Any] | None = None,
              resume: bool = False) -> TrainResult:
        """Train until `total_steps` or `max_train_seconds`, or Ctrl-C; returns the result.

        `workflow`: a RolloutWorkflow (`async def arun_episode(engine, data)`), an agent
        (`async def run(data, **kw)`), a reward function, or "package.module:Name" (a class or
        factory called with `workflow_kwargs`); None: the config's `workflow`. `eval_workflow`:
        the same kinds, for evaluation (None: the workflow's own `aevaluate`, else one episode
        per held-out row). `loss`: a PolicyLoss object or dotted path (None: `actor.loss`).
        `resume`: continue `run_dir` from its latest checkpoint.
        """
        self.plugins = _Plugins(workflow, workflow_kwargs, eval_workflow, loss)
        self.resume = resume
        if self.cfg.launcher == "ray" and not os.environ.get(RANK_ENV):
            return run_on_ray(self)  # the driver: each rank actor runs `_run` below
        return self._run()

    # ---- the job --------------------------------------------------------------------------------
    def _run(self) -> TrainResult:
        """Under torchrun every rank calls this; rank 0 leads, the others follow its trainer."""
        cfg = self.cfg
        # a GPU trainer with a CPU in-process engine is refused before anything loads
        check_engine_placement(resolve_device(cfg.train.device), cfg.inference.mode,
                               cfg.inference.engine)
        if is_distributed():
            from asyncrl.train.fsdp import init_distributed

            init_distributed()
        leader = rank() == 0
        if leader:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.run_dir / CONFIG_FILE)
        torch.manual_seed(cfg.seed)
        with trainer_threads(cfg):
            # every rank takes part in the SFT warm start (FSDP2 under torchrun); rank 0
            # decides what to resume, the others are told
            base = resolve_base_model(cfg, self.console if leader else Console(quiet=True))
            state, policy_dir, self.ckpt, self.base = broadcast(
                self._initial_state(base) if leader else None)
            tokenizer = load_tokenizer(policy_dir, cfg.model.trust_remote_code)
            group = self._build_trainer(policy_dir, tokenizer)
            try:
                if not leader:
                    group.follow()
                    return self.result
                try:
                    self._lead(state, policy_dir, tokenizer, group)
                finally:
                    group.stop()
                return self.result
            finally:
                leave_process_group()

    def _lead(self, state: LoopState, policy_dir: Path, tokenizer: Any,
              group: TrainerGroup) -> None:
        cfg = self.cfg
        dataset = cfg.data.build()
        self.eval_rows = dataset.eval_rows()[: cfg.eval.size]
        with contextlib.ExitStack() as stack:
            reward_fn = stack.enter_context(open_run_reward(cfg.reward))
            engines = stack.enter_context(open_rollout_engines(
                cfg.inference.trusting(cfg.model.trust_remote_code), policy_dir,
                self.run_dir / "logs",
                lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                version=group.trainer.version.value,
                ray_cfg=cfg.ray if cfg.launcher == "ray" else None,
                shard_size=cfg.checkpoint_shard_size,
                lora=LoraServing(cfg.train.lora.r, cfg.rollout.max_head_offpolicyness + 1)
                if lora_enabled(cfg.train.lora) else None))
            rollout_cfg = cfg.rollout.model_copy(
                update={"dump_dir": cfg.rollout.dump_dir or str(self.run_dir / "rollouts")})
            # the executor follows the version the engines serve (the trainer's, once pushed)
            executor = stack.enter_context(WorkflowExecutor(engines.engine, rollout_cfg,
                                                            engines.version))
            if self.resume:
                executor.load_state_dict(state.rollout)
            ctx = WorkflowContext(cfg, tokenizer, engines.engine, reward_fn, getattr(
                group.trainer.model.config, "max_position_embeddings", None))
            workflow = resolve_workflow(self.plugins.workflow, ctx, self.plugins.workflow_kwargs)
            evaluator = resolve_evaluator(self.plugins.eval_workflow, workflow, ctx)
            engines.check = self._logprob_check(group, tokenizer)
            limit = cfg.watchdog.sync_timeout_s
            if group.trainer.lora is not None:  # pushes are adapters; the engines hold the base
                engines.adapter = AdapterSpec(group.trainer.lora.scale,
                                              peft_config_dict(group.trainer.model),
                                              cfg.rollout.max_head_offpolicyness + 1)
                if group.trainer.version.value > 0:  # resumed: the checkpoint's adapter first
                    bounded(executor, engines.push(group.state_dict(),
                                                   group.trainer.version.value), limit,
                            "the adapter push of the resumed checkpoint",
                            "watchdog.sync_timeout_s")
            bounded(executor, engines.start_checks(group.trainer.version.value), limit,
                     "the servers' start-up checks", "watchdog.sync_timeout_s")
            if engines.remote and group.trainer.version.value > 0 and engines.adapter is None:
                # servers started from a checkpoint report version 0: one push labels them
                bounded(executor, engines.push(group.state_dict(), group.trainer.version.value,
                                                group.trainer.model.config, tokenizer), limit,
                         "the weight push of the resumed checkpoint", "watchdog.sync_timeout_s")
            stream = DataStream(dataset.train_rows(), cfg.seed, state.data_position)
            logger = stack.enter_context(RunLogger(
                self.run_dir, cfg.logging, config=cfg.model_dump(mode="json"),
                resume_step=state.step if self.resume else None))
            progress = stack.enter_context(TrainProgress(
                cfg.total_steps, cfg.max_train_seconds, self.console, start_step=state.step))
            stop = stack.enter_context(StopRequest())
            TrainLoop(self, state, tokenizer, workflow, evaluator, engines, group, executor,
                      stream, logger, progress, stop, reward_fn).run()

    def _logprob_check(self, group: TrainerGroup, tokenizer: Any) -> LogprobCheck | None:
        """The post-update canary: the first two eval rows' prompts (in-distribution text)."""
        from asyncrl.models.chat import encode_chat_prompt

        cfg = self.cfg
        rows = [r for r in self.eval_rows[:2] if "messages" in r]
        if not rows:
            return None
        kwargs = cfg.model.template_kwargs()
        prompts = [encode_chat_prompt(tokenizer, r["messages"], template_kwargs=kwargs)
                   for r in rows]
        return LogprobCheck(group.score, prompts, cfg.gconfig.temperature,
                            cfg.inference.check_logprobs_tolerance)

    def _initial_state(self, base: Path) -> tuple[LoopState, Path, Path | None, Path]:
        """(loop state, weights the engines start from, checkpoint to load, base model)."""
        if self.resume:
            ckpt = latest_checkpoint(self.run_dir)
            state = load_loop_state(ckpt)
            self.console.print(f"resuming {self.run_dir} from {ckpt.name} (step {state.step})")
            # LoRA: engines merge adapters into the base model they start from, and the trainer
            # restores base + adapter from the checkpoint's state
            start = base if lora_enabled(self.cfg.train.lora) else ckpt / "policy"
            return state, start, ckpt, base
        return LoopState(0, 0, 0.0, 0.0), base, None, base

    def _build_trainer(self, policy_dir: Path, tokenizer: Any) -> TrainerGroup:
        from asyncrl.train.checkpoint import load_state
        from asyncrl.train.heads import LogprobHead

        cfg = self.cfg
        # the LR schedule counts optimizer steps: ppo_n_minibatches per policy version
        steps = cfg.total_steps * cfg.actor.ppo_n_minibatches
        trust = cfg.model.trust_remote_code
        head = LogprobHead(cfg.gconfig.temperature)  # the sampler's
        trainer = load_engine(policy_dir, cfg.train, cfg.model.dtype, trust, total_steps=steps,
                              head=head, lora=cfg.train.lora)
        if self.ckpt is not None:  # weights, optimizer, RNG and the version
            load_state(self.ckpt / TRAINER, trainer.parallel, {"engine": trainer})
        ref = None
        if cfg.actor.ppo.kl_coef > 0:  # the reference is the starting model, resumed or not
            ref = load_engine(self.base, cfg.train, cfg.model.dtype, trust, head=head,
                              trainable=False)
        critic = None
        if cfg.actor.advantage.estimator == "gae":  # a fresh value head on the base model's body
            critic = load_critic(self.base, cfg.critic, cfg.model.dtype, steps, trust)
            if self.ckpt is not None:
                load_state(self.ckpt / CRITIC, critic.parallel, {"engine": critic})
        loss: PolicyLoss | None = resolve_loss(self.plugins.loss, cfg)
        return TrainerGroup(trainer, cfg.actor, ref, tokenizer, loss, critic,
                            cfg.critic.value_eps_clip)


def _with_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]
                    ) -> dict[str, Any]:
    from asyncrl.config import parse_override, set_dotted

    for item in overrides:
        set_dotted(data, *parse_override(item))
    return data


__all__ = ["TrainResult", "TrainRunConfig", "Trainer"]
