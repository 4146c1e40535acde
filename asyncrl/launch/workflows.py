"""What a user hands the trainer, turned into the workflow the executor runs and its evaluator.

`Trainer.train(workflow=...)` (and `eval_workflow=...`) accept:
- a RolloutWorkflow: any object with `async def arun_episode(engine, data)`; used as it is;
- an agent: an object (or class) with `async def run(data, **kw)`; run through the proxy,
  `gconfig.n_samples` runs per prompt form the group (`workflow.kind: agent` options apply);
- a reward function `reward(completion_text, data) -> float` (sync or async): the config's built-in
  workflow (`rlvr`, or `multi_turn`) with that reward;
- `"package.module:Name"`: imported, then as above; a class or factory is called with `kwargs`
  plus whichever of `tokenizer`, `gconfig`, `reward_fn`, `chat` its signature names;
- nothing: the config's `workflow` (kind rlvr | multi_turn | agent | custom).

The evaluator is the eval workflow's (or else the workflow's) own `aevaluate` when it has one
(the built-in workflows and the agent workflow do), else `EpisodeEvaluator`: one episode per
held-out row, mean reward. Nothing here is special-cased in the training loop.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from asyncrl.api import Evaluator, InferenceEngine, RolloutWorkflow
from asyncrl.errors import UserError
from asyncrl.imports import import_object
from asyncrl.launch.train_config import (AgentWorkflowConfig, CustomWorkflowConfig,
                                         MultiTurnWorkflowConfig, TrainRunConfig)
from asyncrl.reward.call import RewardFn
from asyncrl.rollout.episode_eval import EpisodeEvaluator
from asyncrl.rollout.group import GroupedWorkflow

# chat: the model's ChatOptions (template variables, reasoning and tool-call parsers)
INJECTABLE = ("tokenizer", "gconfig", "reward_fn", "chat")


@dataclass
class WorkflowContext:
    """What the job has that a workflow may need."""

    cfg: TrainRunConfig
    tokenizer: Any
    engine: InferenceEngine  # the rollout engine the proxy forwards agent requests to
    reward_fn: RewardFn | None  # the config's `reward`, opened by the job
    context_length: int | None = None


def _is_workflow(obj: Any) -> bool:
    return callable(getattr(obj, "arun_episode", None))


def _is_agent(obj: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(obj, "run", None))


def _call_factory(factory: Any, kwargs: dict[str, Any], ctx: WorkflowContext, what: str) -> Any:
    """`factory(**kwargs)` plus the context values its signature names and kwargs do not set."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    context = {"tokenizer": ctx.tokenizer, "gconfig": ctx.cfg.gconfig, "reward_fn": ctx.reward_fn,
               "chat": ctx.cfg.model}
    extra = {k: context[k] for k in INJECTABLE if k in params and k not in kwargs}
    try:
        return factory(**kwargs, **extra)
    except TypeError as err:
        raise UserError(f"{what}: calling {getattr(factory, '__name__', factory)!r} with kwargs "
                        f"{sorted(kwargs)} failed: {err}") from err


def _agent_workflow(agent: Any, cfg: AgentWorkflowConfig, ctx: WorkflowContext) -> Any:
    from asyncrl.proxy.server import ProxyServer
    from asyncrl.proxy.workflow import AgentWorkflow

    try:
        proxy = ProxyServer(ctx.engine, ctx.tokenizer, cfg.proxy, context_length=ctx.context_length,
                            chat=ctx.cfg.model)
        inner = AgentWorkflow(agent, proxy, cfg, eval_concurrency=ctx.cfg.eval.concurrency)
    except ValueError as err:
        raise UserError(f"workflow.path: {err}") from err
    n = ctx.cfg.gconfig.n_samples
    return GroupedWorkflow(inner, n) if n > 1 else inner


def _reward_workflow(reward_fn: RewardFn, ctx: WorkflowContext) -> RolloutWorkflow:
    """The config's built-in reward-driven workflow (rlvr, or multi_turn) with `reward_fn`."""
    from asyncrl.rollout.multi_turn import MultiTurnConfig, MultiTurnWorkflow
    from asyncrl.rollout.rlvr import RLVRWorkflow

    cfg = ctx.cfg
    if isinstance(cfg.workflow, MultiTurnWorkflowConfig):
        mt = MultiTurnConfig(**cfg.workflow.model_dump(exclude={"kind"}))
        inner = MultiTurnWorkflow(reward_fn, cfg.gconfig, ctx.tokenizer, mt, eval_cfg=cfg.eval,
                                  chat=cfg.model)
        return GroupedWorkflow(inner, cfg.gconfig.n_samples)
    if isinstance(cfg.workflow, (AgentWorkflowConfig, CustomWorkflowConfig)):
        raise UserError(f"a reward function drives the built-in workflows (workflow.kind rlvr "
                        f"or multi_turn); this config has workflow.kind={cfg.workflow.kind!r}")
    return RLVRWorkflow(reward_fn, cfg.gconfig, ctx.tokenizer, eval_cfg=cfg.eval, chat=cfg.model,
                        reward_sees_reasoning=cfg.workflow.reward_sees_reasoning)


def resolve_workflow(spec: Any, ctx: WorkflowContext, kwargs: dict[str, Any] | None = None,
                     what: str = "workflow") -> RolloutWorkflow:
    """The workflow `spec` names (see the module docstring); None: the config's."""
    cfg = ctx.cfg
    if spec is None:
        wf = cfg.workflow
        if isinstance(wf, CustomWorkflowConfig):
            return resolve_workflow(wf.path, ctx, wf.kwargs, "workflow.path")
        if isinstance(wf, AgentWorkflowConfig):
            if wf.path is None:
                raise UserError("workflow.kind=agent needs workflow.path "
                                "(package.module:AgentClass) or an agent passed to "
                                "Trainer.train(workflow=...)")
            return _agent_workflow(wf.path, wf, ctx)
        if ctx.reward_fn is None:
            raise UserError("the built-in workflow needs a reward: set `reward` in the config")
        return _reward_workflow(ctx.reward_fn, ctx)
    if isinstance(spec, str):
        return resolve_workflow(import_object(spec, what), ctx, kwargs, what)
    agent_cfg = cfg.workflow if isinstance(cfg.workflow, AgentWorkflowConfig) else \
        AgentWorkflowConfig()
    if inspect.isclass(spec):
        if _is_agent(spec):  # an agent class: AgentWorkflow instantiates it with init_kwargs
            if kwargs:
                agent_cfg = agent_cfg.model_copy(update={"init_kwargs": kwargs})
            return _agent_workflow(spec, agent_cfg, ctx)
        return resolve_workflow(_call_factory(spec, kwargs or {}, ctx, what), ctx, None, what)
    if _is_workflow(spec):
        return spec
    if _is_agent(spec):
        return _agent_workflow(spec, agent_cfg, ctx)
    if callable(spec):
        if kwargs is not None or _names_a_factory(spec):
            return resolve_workflow(_call_factory(spec, kwargs or {}, ctx, what), ctx, None, what)
        return _reward_workflow(spec, ctx)
    raise UserError(f"{what} {spec!r}: expected a RolloutWorkflow (async def arun_episode), an "
                    "agent (async def run), a reward function, or 'package.module:Name'")


def _names_a_factory(fn: Any) -> bool:
    """A callable whose required parameters are all context names (`make(tokenizer, n=4)`) is
    a factory, not a reward function (which requires the completion and the data row)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return bool(required) and all(name in INJECTABLE for name in required)


def resolve_evaluator(eval_spec: Any, workflow: RolloutWorkflow, ctx: WorkflowContext,
                      kwargs: dict[str, Any] | None = None) -> Evaluator:
    """`eval_spec` resolved like a workflow (None: the training workflow), evaluated by its own
    `aevaluate` or else one episode per row. An object with only `aevaluate` (an Evaluator, or
    a class of one, called like a workflow factory) is taken as it is."""
    target: Any = workflow
    if eval_spec is not None:
        what = "eval_workflow"
        target = import_object(eval_spec, what) if isinstance(eval_spec, str) else eval_spec
        if inspect.isclass(target) and callable(getattr(target, "aevaluate", None)):
            target = _call_factory(target, kwargs or {}, ctx, what)
        if not isinstance(target, Evaluator):
            target = resolve_workflow(target, ctx, kwargs, what)
    if isinstance(target, Evaluator):
        return target
    return EpisodeEvaluator(target, ctx.cfg.eval.concurrency)


def resolve_loss(spec: Any, cfg: TrainRunConfig) -> Any:
    """The PolicyLoss: `spec` (an object or dotted path) or the config's `actor.loss`; None for
    the built-in PPO loss, which the actor builds from `actor.ppo`."""
    from asyncrl.api import PolicyLoss

    if spec is None:
        if cfg.actor.loss == "ppo":
            return None
        spec = cfg.actor.loss
    kwargs = cfg.actor.loss_kwargs
    if isinstance(spec, str):
        spec = import_object(spec, "actor.loss")
        if inspect.isclass(spec) or kwargs:
            spec = spec(**kwargs)
    elif inspect.isclass(spec):
        spec = spec(**kwargs)
    if not isinstance(spec, PolicyLoss):
        raise UserError(f"actor.loss {spec!r} is not callable; expected a PolicyLoss: "
                        "loss(logprobs, inputs: LossInputs, normalizer) -> (loss, stats)")
    return spec
