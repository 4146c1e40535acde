"""`asyncrl train` and `Trainer`: the one place a training job is decided and wired.

    Trainer(config).train(workflow=..., reward=..., loss=...)
      -> the launcher runs `run_rank(job)` where the job belongs: here (one process, or each
         torchrun rank), or in each trainer rank's actor on a Ray cluster
    run_rank: every rank builds the trainer (FSDP2 under torchrun); rank 0 also builds the
      rollout side (engines, workflow, executor), the data stream, the logger, and registers
      every stateful part with the checkpointer; a resume loads them all; then rank 0 runs
      `TrainLoop(parts, context)` (launch/train_loop.py) and the other ranks follow its steps.

`Trainer.train` takes objects: a RolloutWorkflow or an agent (`workflow`), an Evaluator or
workflow to evaluate with (`eval_workflow`), a reward function for the built-in workflows
(`reward`), a PolicyLoss (`loss`); what is not given comes from the config's plugin sections.
`resume=True` continues the run directory from its latest checkpoint: weights, optimizer, LR
schedule, RNG, policy version, data position, staleness counters, elapsed time, the metrics
curve, and the episodes that were in flight (they continue from the tokens they had).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from asyncrl.api import Closable, PolicyLoss, ReportsMetrics, RolloutWorkflow, Stateful
from asyncrl.config import parse_override, set_dotted
from asyncrl.errors import UserError
from asyncrl.inference.backend_protocol import LoraServing
from asyncrl.inference.config import EngineSettings
from asyncrl.launch.data_stream import DataStream
from asyncrl.launch.judge_engine import open_run_reward
from asyncrl.models.config import is_mixture_of_experts
from asyncrl.models.tokenizer_check import check_chat_round_trip
from asyncrl.reward.call import check_reward_call
from asyncrl.launch.progress import TrainProgress
from asyncrl.launch.rollout_engines import AdapterSpec, open_rollout_engines
from asyncrl.launch.rollout_monitor import RolloutMonitor
from asyncrl.launch.run_checkpoints import (LoopState, PolicyExport, RunCheckpointer,
                                            latest_checkpoint)
from asyncrl.launch.run_events import EventKind, RunEvents
from asyncrl.launch.run_logger import RunLogger
from asyncrl.launch.step_samples import StepSamples
from asyncrl.launch.train_config import CONFIG_FILE, InferenceLaunchConfig, TrainRunConfig
from asyncrl.launch.train_loop import (LoopParts, RunContext, StopRequest, TrainLoop,
                                       TrainResult, bounded)
from asyncrl.launch.trainer_group import TrainerGroup, parallelism
from asyncrl.launch.weight_check import LogprobCheck
from asyncrl.launch.workflows import (AgentWorkflowConfig, WorkflowContext, evaluator_for,
                                      workflow_from_object)
from asyncrl.models.device import resolve_device
from asyncrl.models.loading import load_tokenizer, resolve_model_dir
from asyncrl.models.vision import row_prompt, vision_encoder
from asyncrl.rollout.executor import WorkflowExecutor
from asyncrl.train.config import lora_enabled
from asyncrl.train.critic import load_critic
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.heads import LogprobHead
from asyncrl.train.parallel import Parallelism
from asyncrl.train.ppo_actor import PPOActor
from asyncrl.train.route_replay import Mode


@dataclass(frozen=True)
class TrainJob:
    """What one training run is (picklable: a Ray launcher ships it to every rank)."""

    cfg: TrainRunConfig
    run_dir: Path
    workflow: Any = None  # a RolloutWorkflow or an agent; None: cfg.workflow
    eval_workflow: Any = None  # an Evaluator or a workflow; None: the workflow's own
    reward: Any = None  # a reward function for the built-in workflows; None: cfg.reward
    loss: PolicyLoss | None = None  # None: cfg.actor.loss
    resume: bool = False


class Trainer:
    """The asynchronous RL trainer: `Trainer(config).train(workflow=...)`.

    `config`: a TrainRunConfig, a YAML path, or a dict of its fields (with `overrides`, dotted
    `key=value` strings, on top). `run_dir`: where logs, checkpoints and the resolved config go
    (default: `config.output_dir`, else runs/<UTC timestamp>).
    """

    def __init__(self, config: TrainRunConfig | str | Path | dict[str, Any], *,
                 run_dir: str | Path | None = None,
                 overrides: list[str] | tuple[str, ...] = ()) -> None:
        if isinstance(config, (str, Path)):
            config = TrainRunConfig.load(str(config), list(overrides))
        elif isinstance(config, dict) or overrides:
            data = config if isinstance(config, dict) else config.to_dict()
            for item in overrides:
                set_dotted(data, *parse_override(item))
            config = TrainRunConfig.from_dict(data)
        self.cfg = config
        self.run_dir = Path(run_dir) if run_dir is not None else (
            Path(config.output_dir) if config.output_dir else default_run_dir())

    def train(self, workflow: Any = None, *, eval_workflow: Any = None, reward: Any = None,
              loss: PolicyLoss | None = None, resume: bool = False) -> TrainResult:
        """Train until `total_steps` or `max_train_seconds`, or Ctrl-C; returns the result.

        `workflow`: a RolloutWorkflow (`async def arun_episode(engine, data)`) or an agent
        (`async def run(data, **kw)`, an object or its class). `eval_workflow`: an Evaluator
        (`async def aevaluate(engine, rows)`) or a workflow (None: the workflow's own
        `aevaluate`, else one episode per held-out row). `reward`: `reward(completion, row)`,
        sync or async, for the config's built-in workflow. `loss`: a PolicyLoss. `resume`:
        continue `run_dir` from its latest checkpoint.
        """
        if reward is not None:
            check_reward_call(reward, "Trainer.train(reward=...)")
        job = TrainJob(self.cfg, self.run_dir, workflow, eval_workflow, reward, loss, resume)
        return self.cfg.launcher.build().run(job, run_rank)


def default_run_dir() -> Path:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / stamp


def run_rank(job: TrainJob) -> TrainResult:
    """The job on this process: every torchrun (or Ray) rank calls it; rank 0 leads."""
    cfg = job.cfg
    # a GPU trainer with a CPU in-process engine is refused before anything loads
    check_engine_placement(resolve_device(cfg.train.device), cfg.inference.mode,
                           cfg.inference.engine)
    parallel = parallelism(cfg.train.device)  # joins the process group under torchrun
    leader = parallel.rank == 0
    console = Console(stderr=True, quiet=not leader)
    if leader:
        job.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save(job.run_dir / CONFIG_FILE)
    torch.manual_seed(cfg.seed)
    try:
        with trainer_threads(cfg):
            if cfg.launcher.trainer_cpu_ids():
                console.print(f"trainer: {torch.get_num_threads()} torch threads on CPUs "
                              f"{sorted(os.sched_getaffinity(0))}")
            base = resolve_base_model(cfg, console)  # every rank takes part in a warm start
            ckpt = parallel.broadcast_object(latest_checkpoint(job.run_dir)
                                             if job.resume and leader else None)
            tokenizer = load_tokenizer(base, cfg.model.trust_remote_code)
            group = build_trainer(cfg, base, job.loss, parallel)
            if not leader:
                group.follow(checkpointer(job, group, tokenizer, base))
                return TrainResult(job.run_dir)
            try:
                return lead(job, group, base, tokenizer, ckpt, console)
            finally:
                group.stop()
    finally:
        parallel.close()


def check_engine_placement(trainer: torch.device, mode: str, engine: EngineSettings) -> None:
    """ValueError when the trainer is on CUDA and the in-process engine would run on the CPU (a
    trainer on the GPU would wait on rollouts generated orders of magnitude slower, which looks
    like a hang); servers (mode "local" / "remote") choose their own devices."""
    if mode == "inprocess" and trainer.type == "cuda" and \
            resolve_device(engine.device).type == "cpu":
        raise ValueError(
            f"inference.engine.device={engine.device!r} puts the in-process engine on the CPU "
            f"while the trainer runs on {trainer}: every rollout would be generated on the CPU. "
            "Set inference.engine.device='auto' or 'cuda' to share the trainer's GPU (its share "
            f"is inference.engine.gpu_memory_fraction={engine.gpu_memory_fraction}), or run the "
            "engines as servers: inference.mode='local' (the job starts them) or 'remote' "
            "(inference.remote.addresses)"
        )


def resolve_base_model(cfg: TrainRunConfig, console: Console) -> Path:
    """The base model's directory: `model.path` (a hub id resolved once, here, to its cached
    snapshot, so trainer, critic, reference and engines all read the same files), else the
    SFT warm start of the tiny model."""
    if cfg.model.path:
        return resolve_model_dir(cfg.model)
    from asyncrl.launch.sft import run_sft_job

    rl = (f"{cfg.max_train_seconds / 60:.0f} min of RL training"
          if cfg.max_train_seconds is not None else f"{cfg.total_steps} RL steps")
    every = [f"{cfg.eval.every} steps"] if cfg.eval.every else []
    if cfg.eval.every_s is not None:
        every.append(f"{cfg.eval.every_s:g} s")
    extra = f", plus evaluations every {' or '.join(every)}" if every else ""
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
    cores = len(os.sched_getaffinity(0))  # what this process may use (taskset, trainer_cpus)
    torch.set_num_threads(cfg.torch_threads or max(1, cores // ranks_here))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_trainer(cfg: TrainRunConfig, base: Path, loss: PolicyLoss | None,
                  parallel: Parallelism) -> TrainerGroup:
    """The policy (from the base model; a resume loads its state later), the reference when
    the KL term is on, the critic for GAE, and the actor driving them."""
    steps = cfg.total_steps * cfg.actor.ppo_n_minibatches  # the LR schedule's optimizer steps
    trust, dtype = cfg.model.trust_remote_code, cfg.model.dtype
    head = LogprobHead(cfg.gconfig.temperature)  # the sampler's
    policy = HFTrainEngine.from_pretrained(base, cfg.train, dtype, trust, total_steps=steps,
                                           head=head, lora=cfg.train.lora, parallel=parallel,
                                           routing=routing_mode(cfg, base))
    ref = None
    if cfg.actor.ppo.kl_coef > 0:  # the reference is the starting model, resumed or not
        ref = HFTrainEngine.from_pretrained(base, cfg.train, dtype, trust, head=head,
                                            trainable=False, parallel=parallel)
    critic = None
    if cfg.actor.advantage.estimator == "gae":  # a fresh value head on the base model's body
        critic = load_critic(base, cfg.critic, dtype, steps, parallel, trust)
    if loss is not None and not isinstance(loss, PolicyLoss):
        raise UserError(f"loss {loss!r} is not a PolicyLoss: a callable loss(logprobs, inputs, "
                        "normalizer) -> (loss, stats) with `normalize_by` and `needs_entropy`")
    actor = PPOActor(policy, cfg.actor, ref, loss, critic, cfg.critic.value_eps_clip,
                     record_groups=cfg.logging.sample_groups)
    return TrainerGroup(policy, actor)


def routing_mode(cfg: TrainRunConfig, base: Path) -> Mode | None:
    """How the trainer treats a mixture-of-experts policy's routes: replayed (actor.moe.
    routing_replay) or monitored; None for a dense model (refused with replay)."""
    if not is_mixture_of_experts(base):
        if cfg.actor.moe.routing_replay:
            raise UserError(f"actor.moe.routing_replay=true needs a mixture-of-experts model; "
                            f"{base} is dense (its config.json names no experts)")
        return None
    return Mode.REPLAY if cfg.actor.moe.routing_replay else Mode.OBSERVE


def with_routes(cfg: TrainRunConfig, inference: InferenceLaunchConfig, base: Path,
                console: Console) -> InferenceLaunchConfig:
    """The rollout engines of a mixture-of-experts policy record its routes where they can (the
    built-in engine in process); elsewhere the run says at start that it trains without them."""
    if not is_mixture_of_experts(base):
        return inference
    if inference.mode == "inprocess":
        engine = inference.engine.model_copy(update={"record_routes": True})
        return inference.model_copy(update={"engine": engine})
    if cfg.actor.moe.routing_replay:
        console.print(f"[yellow]actor.moe.routing_replay: the rollout servers (inference.mode="
                      f"{inference.mode!r}, backend {inference.backend.kind!r}) return no routes;"
                      " training without replay (moe/unreplayed_tokens counts the tokens)")
    return inference


def checkpointer(job: TrainJob, group: TrainerGroup, tokenizer: Any, base: Path,
                 plain: dict[str, Stateful] | None = None) -> RunCheckpointer:
    """Where every stateful part of the run is registered: the trainer's (the same on every
    rank, in this order) and rank 0's `plain` ones; every rank exports policy/ together."""
    sharded: dict[str, Stateful] = {"trainer": group.trainer}
    if group.actor.critic is not None:
        sharded["critic"] = group.actor.critic
    return RunCheckpointer(job.run_dir, group.trainer.parallel, sharded, plain,
                           PolicyExport(group.trainer, tokenizer, job.cfg.checkpoint_shard_size,
                                        base))


def lead(job: TrainJob, group: TrainerGroup, base: Path, tokenizer: Any, ckpt: Path | None,
         console: Console) -> TrainResult:
    """Rank 0: build the rollout side and the run's bookkeeping, load a checkpoint, loop."""
    cfg = job.cfg
    dataset = cfg.data.build()
    eval_rows = dataset.eval_rows()[: cfg.eval.size]
    trainer = group.trainer
    state, stream = LoopState(), DataStream(dataset.train_rows(), cfg.seed)
    vision = vision_encoder(base, cfg.model.trust_remote_code)
    first = next((r for r in dataset.train_rows()[:1] if "messages" in r), None)
    if first is not None:
        check_first_prompt(cfg, tokenizer, vision, first, base,
                           context_length(cfg, group.trainer))
    monitor = RolloutMonitor(cfg.filter_uniform_groups)
    with contextlib.ExitStack() as stack:
        reward = job.reward
        if reward is None:
            reward = stack.enter_context(open_run_reward(cfg.reward))
        lora = lora_enabled(cfg.train.lora)
        engines = stack.enter_context(open_rollout_engines(
            with_routes(cfg, cfg.inference.trusting(cfg.model.trust_remote_code), base, console),
            base, job.run_dir / "logs",
            cfg.launcher.build(), lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            shard_size=cfg.checkpoint_shard_size,
            lora=LoraServing(cfg.train.lora.r, cfg.rollout.max_head_offpolicyness + 1)
            if lora else None,
            check=logprob_check(cfg, group, tokenizer, eval_rows, vision),
            adapter=adapter_spec(cfg, trainer) if lora else None))
        ctx = WorkflowContext(tokenizer, engines.engine, reward, cfg.gconfig, cfg.model,
                              cfg.evaluation, context_length(cfg, trainer), vision)
        workflow = the_workflow(job, ctx)
        evaluator = evaluator_for(job.eval_workflow, workflow, ctx, cfg.eval.concurrency)
        rollout_cfg = cfg.rollout.model_copy(
            update={"dump_dir": cfg.rollout.dump_dir or str(job.run_dir / "rollouts")})
        # the executor follows the version the engines serve (the trainer's, once pushed)
        executor = stack.enter_context(WorkflowExecutor(engines.engine, rollout_cfg, workflow,
                                                        engines.version, monitor))
        saver = checkpointer(job, group, tokenizer, base,
                             {"loop": state, "data": stream, "rollout": executor})
        events = stack.enter_context(RunEvents(job.run_dir))
        stack.enter_context(events.capture())
        limit = cfg.watchdog.sync_timeout_s
        bounded(executor, engines.check_servers(), limit, "the servers' start-up checks",
                "watchdog.sync_timeout_s")
        if ckpt is not None:
            console.print(f"resuming {job.run_dir} from {ckpt.name}")
            group.load(saver, ckpt)
            # the engines started from the base model: the checkpoint's weights, labelled
            bounded(executor, engines.push(group.state_dict(), trainer.version.value), limit,
                    "the weight push of the resumed checkpoint", "watchdog.sync_timeout_s")
            events.step = state.step
            restored = executor.stats()["restored"]
            events.emit(EventKind.RESUME, f"resumed from {ckpt.name} at step {state.step}, "
                        f"version {trainer.version.value}; episodes in flight restored: "
                        + (", ".join(f"{v} {k}" for k, v in restored.items()) or "none"),
                        checkpoint=str(ckpt), version=trainer.version.value, episodes=restored)
        else:
            events.emit(EventKind.START, f"started {job.run_dir.name} from {base}",
                        model=str(base))
        bounded(executor, engines.canary(trainer.version.value), limit,
                "the start-up logprob check", "watchdog.sync_timeout_s")
        logger = stack.enter_context(RunLogger(
            job.run_dir, cfg.logging, config=cfg.model_dump(mode="json"),
            resume_step=state.step if ckpt is not None else None))
        progress = stack.enter_context(TrainProgress(
            cfg.total_steps, cfg.max_train_seconds, console, start_step=state.step))
        stop = stack.enter_context(StopRequest())
        samples = StepSamples(job.run_dir, cfg.logging.sample_groups,
                              lambda ids: tokenizer.batch_decode([[i] for i in ids]))
        parts = LoopParts(group, engines, executor, evaluator, stream, monitor, saver,
                          logger, progress, stop, events, samples,
                          reporters=tuple(r for r in (workflow, reward)
                                          if isinstance(r, ReportsMetrics)),
                          closables=tuple(w for w in (workflow,) if isinstance(w, Closable)))
        return TrainLoop(parts, RunContext(cfg, job.run_dir, eval_rows, state)).run()


def the_workflow(job: TrainJob, ctx: WorkflowContext) -> RolloutWorkflow:
    """The job's workflow object, else the one its config builds."""
    cfg = job.cfg
    if job.workflow is None:
        return cfg.workflow.build(ctx)
    agent_cfg = cfg.workflow if isinstance(cfg.workflow, AgentWorkflowConfig) else \
        AgentWorkflowConfig()
    return workflow_from_object(job.workflow, agent_cfg, ctx)


def check_first_prompt(cfg: TrainRunConfig, tokenizer: Any, vision: Any, row: dict[str, Any],
                       base: Path, context: int | None) -> None:
    """Before step 1, on the first training row: the prompt as the template renders it reaches
    the model intact, and a completion fits after it (`check_room`)."""
    kwargs = cfg.model.template_kwargs()
    check_chat_round_trip(tokenizer, row["messages"], kwargs, f"model {base}")
    try:
        prompt = row_prompt(tokenizer, vision, row, kwargs)[0]
    except ValueError:  # an undecodable image: the row is rejected when it is drawn
        return
    check_room(cfg, len(prompt), context)


def check_room(cfg: TrainRunConfig, prompt_tokens: int, context: int | None) -> None:
    """UserError, before step 1, when a completion of gconfig.max_new_tokens (or an eval
    answer of eval.max_new_tokens) after the first prompt would not fit in the context: the
    engines never truncate, so every episode would fail."""
    limits = {"gconfig.max_new_tokens": cfg.gconfig.max_new_tokens,
              "eval.max_new_tokens": cfg.evaluation.max_new_tokens}
    for setting, tokens in limits.items():
        if context is not None and prompt_tokens + tokens > context:
            raise UserError(f"{setting}={tokens}: the first prompt ({prompt_tokens} tokens) + "
                            f"{tokens} = {prompt_tokens + tokens} exceeds the context of {context} "
                            "tokens (the model's max_position_embeddings, or "
                            f"inference.engine.max_seq_len); lower {setting}")


def context_length(cfg: TrainRunConfig, trainer: Any) -> int | None:
    """The longest sequence the engines take: the model's, or the in-process engine's own."""
    model = getattr(trainer.model.config, "max_position_embeddings", None)
    engine = cfg.inference.engine.max_seq_len if cfg.inference.mode == "inprocess" else None
    return min(n for n in (model, engine) if n is not None) if model or engine else None


def logprob_check(cfg: TrainRunConfig, group: TrainerGroup, tokenizer: Any,
                  eval_rows: list[dict[str, Any]], vision: Any) -> LogprobCheck | None:
    """The post-update canary: the first two eval rows' prompts (in-distribution, with their
    images through `vision` for a vision-language model); rows whose prompt cannot be built (an
    undecodable image) are passed over."""
    kwargs = cfg.model.template_kwargs()
    prompts, images = [], []
    for row in (r for r in eval_rows if "messages" in r):
        try:
            ids, pictures = row_prompt(tokenizer, vision, row, kwargs)
        except ValueError:
            continue
        prompts.append(ids)
        images.append(pictures)
        if len(prompts) == 2:
            break
    if not prompts:
        return None
    return LogprobCheck(group.score, prompts, cfg.gconfig.temperature,
                        cfg.inference.check_logprobs_tolerance, images=images)


def adapter_spec(cfg: TrainRunConfig, trainer: Any) -> AdapterSpec:
    """With train.lora, how pushes describe the adapter (engines hold the base model)."""
    from asyncrl.train.lora import peft_config_dict

    return AdapterSpec(trainer.lora.scale, peft_config_dict(trainer.model),
                       cfg.rollout.max_head_offpolicyness + 1)


__all__ = ["TrainJob", "TrainResult", "TrainRunConfig", "Trainer"]
