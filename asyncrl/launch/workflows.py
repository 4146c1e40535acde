"""The workflow kinds a config names (`workflow: {kind: ...}`), each a config whose `build(ctx)` makes
the RolloutWorkflow the executor runs: the `WORKFLOWS` registry (asyncrl/plugins.py).

- rlvr: one prompt, `gconfig.n_samples` sampled answers, one reward each;
- multi_turn: answer, feedback, retry; `gconfig.n_samples` episodes per prompt form the group;
- tool_calls: the policy calls tools over HTTP between turns (a tool service the job starts, with a
  configured service time, or one at `url`); `gconfig.n_samples` episodes per prompt form the group;
- agent: any agent program (`async def run(data, **kw)`) through the OpenAI-compatible proxy;
- command: an agent that is a program (argv), run per episode against the proxy;
- agent_env: the documents' Agent + gymnasium-style Environment, named by path;
- custom: your own (`path: package.module:Name`, a class or factory called with `kwargs` plus
  whichever of tokenizer, gconfig, reward_fn, chat its signature names); `workflow: {path: ...}`
  without a kind means this one.

`Trainer.train(workflow=obj)` takes objects instead: a RolloutWorkflow as it is, an agent (or agent
class) through the agent kind (`workflow_from_object`). The evaluator is the eval workflow's (else
the workflow's) own `aevaluate`, else one episode per held-out row (`evaluator_for`). Nothing here
is special-cased in the training loop.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

import pydantic

from asyncrl.api import AgentProgram, Evaluator, GenerationConfig, InferenceEngine, RolloutWorkflow
from asyncrl.config import Config
from asyncrl.errors import UserError
from asyncrl.imports import import_object
from asyncrl.models.chat_options import ChatOptions
from asyncrl.plugins import Registry
from asyncrl.proxy.command_agent import CommandLimits
from asyncrl.proxy.config import AgentConfig, ProxyConfig
from asyncrl.rollout.agent_env import AgentEnvConfig
from asyncrl.reward.call import RewardFn
from asyncrl.rollout.answer_eval import EvalConfig
from asyncrl.rollout.multi_turn import MultiTurnConfig
from asyncrl.rollout.tool_service import ToolServiceConfig


@dataclass(frozen=True)
class WorkflowContext:
    """What the job has that a workflow may need."""

    tokenizer: Any
    engine: InferenceEngine  # the rollout engine the agent proxy forwards to
    reward_fn: RewardFn | None  # the run's reward, opened by the job
    gconfig: GenerationConfig
    chat: ChatOptions  # the model's template variables and parsers
    eval: EvalConfig
    context_length: int | None = None  # the longest sequence the engines take
    vision: Any = None  # a vision-language model's VisionPromptEncoder (rows with images)

    def injectable(self) -> dict[str, Any]:
        """What a custom workflow's factory may ask for by parameter name."""
        return {"tokenizer": self.tokenizer, "gconfig": self.gconfig,
                "reward_fn": self.reward_fn, "chat": self.chat}


def _needs_reward(ctx: WorkflowContext, kind: str) -> RewardFn:
    if ctx.reward_fn is None:
        raise UserError(f"workflow.kind={kind} needs a reward: set `reward` in the config or pass "
                        "Trainer.train(reward=...)")
    return ctx.reward_fn


class RLVRWorkflowConfig(Config):
    """One prompt, `gconfig.n_samples` sampled answers, one reward each."""

    # the workflow (WORKFLOWS: rlvr | multi_turn | tool_calls | agent | command | agent_env | custom)
    kind: Literal["rlvr"] = "rlvr"
    # with model.reasoning_parser set, the reward reads only the answer after the reasoning
    # (`</think>`); true: the whole reply (a reward on the reasoning's form or length). The
    # trained tokens are the whole reply either way.
    reward_sees_reasoning: bool = False

    def build(self, ctx: WorkflowContext) -> RolloutWorkflow:
        from asyncrl.rollout.rlvr import RLVRWorkflow

        return RLVRWorkflow(_needs_reward(ctx, self.kind), ctx.gconfig, ctx.tokenizer,
                            eval_cfg=ctx.eval, chat=ctx.chat,
                            reward_sees_reasoning=self.reward_sees_reasoning, vision=ctx.vision)


class MultiTurnWorkflowConfig(MultiTurnConfig):
    """Answer, feedback, retry; `gconfig.n_samples` episodes per prompt form the group."""

    # the workflow (WORKFLOWS: rlvr | multi_turn | tool_calls | agent | command | agent_env | custom)
    kind: Literal["multi_turn"] = "multi_turn"

    def build(self, ctx: WorkflowContext) -> RolloutWorkflow:
        from asyncrl.rollout.group import GroupedWorkflow
        from asyncrl.rollout.multi_turn import MultiTurnWorkflow

        inner = MultiTurnWorkflow(_needs_reward(ctx, self.kind), ctx.gconfig, ctx.tokenizer,
                                  MultiTurnConfig(**self.model_dump(exclude={"kind"})),
                                  eval_cfg=ctx.eval, chat=ctx.chat,
                                  context_length=ctx.context_length)
        return GroupedWorkflow(inner, ctx.gconfig.n_samples)


class ToolCallingWorkflowConfig(Config):
    """The policy calls tools between turns (`asyncrl/rollout/tool_calling.py`): the job starts
    the tool service (`service`) on 127.0.0.1 and stops it at the end, or uses the one at `url`;
    `gconfig.n_samples` episodes per prompt form the group."""

    # the workflow (WORKFLOWS: rlvr | multi_turn | tool_calls | agent | command | agent_env | custom)
    kind: Literal["tool_calls"] = "tool_calls"
    # the tools, their service time and injected failures (the job's own service)
    service: ToolServiceConfig = ToolServiceConfig()
    url: str | None = None  # a tool service already running (then `service` sets only its timeout)
    # `package.module:NAME` of the OpenAI tool definitions the prompt shows; None: no tool list
    # (a policy trained to call its tools without one)
    schemas: str | None = "asyncrl.rollout.calculator:TOOLS"
    max_tool_calls: int = pydantic.Field(1, ge=1)  # tool rounds per episode before the answer
    # with model.reasoning_parser set, the reward reads only the answer after the reasoning
    reward_sees_reasoning: bool = False
    # false: the job's own service answers evaluations at once, without its service time or
    # injected failures (they model training episodes' waits; a job's training clock leaves
    # evaluations out); needs `url` unset
    eval_service_time: bool = True

    @pydantic.model_validator(mode="after")
    def _own_service(self) -> ToolCallingWorkflowConfig:
        if not self.eval_service_time and self.url is not None:
            raise ValueError("workflow.eval_service_time=false needs the job's own tool service "
                             "(workflow.url unset): a service at url keeps its own times")
        return self

    def build(self, ctx: WorkflowContext) -> RolloutWorkflow:
        from asyncrl.rollout.group import GroupedWorkflow
        from asyncrl.rollout.tool_calling import ToolCallingWorkflow
        from asyncrl.rollout.tool_service import ToolClient, ToolServiceProcess

        schemas = None
        if self.schemas is not None:
            schemas = import_object(self.schemas, "workflow.schemas")
            names = sorted(s.get("function", {}).get("name", "?") for s in schemas) \
                if isinstance(schemas, list) else None
            if names is None:
                raise UserError(f"workflow.schemas: {self.schemas!r} is not a list of OpenAI "
                                "tool definitions ({type: function, function: {name, ...}})")
            if self.url is None and set(names) != set(self.service.tools):
                raise UserError(f"workflow.schemas names the tools {names} but "
                                f"workflow.service.tools serves {sorted(self.service.tools)}; "
                                "allowed: the same names")
        reward_fn = _needs_reward(ctx, self.kind)
        process = ToolServiceProcess(self.service) if self.url is None else None
        client = process.client() if process else ToolClient(self.url,
                                                             self.service.client_timeout_s)
        inner = ToolCallingWorkflow(reward_fn, ctx.gconfig, ctx.tokenizer, client, schemas,
                                    self.max_tool_calls, ctx.eval, ctx.chat, ctx.context_length,
                                    self.reward_sees_reasoning,
                                    on_close=process.stop if process else None,
                                    eval_client=None if self.eval_service_time or not process
                                    else process.client(undelayed=True))
        n = ctx.gconfig.n_samples
        return GroupedWorkflow(inner, n) if n > 1 else inner


class AgentWorkflowConfig(AgentConfig):
    """Any agent program (`path: package.module:Class`) talking to the OpenAI-compatible proxy;
    `gconfig.n_samples` runs per prompt form the group. The agent sets its own sampling
    parameters per request; leave temperature unset (1.0) so it matches the trainer's."""

    # the workflow (WORKFLOWS: rlvr | multi_turn | tool_calls | agent | command | agent_env | custom)
    kind: Literal["agent"] = "agent"

    def build(self, ctx: WorkflowContext, agent: Any = None,
              reward_fn: RewardFn | None = None) -> RolloutWorkflow:
        """`agent`: an object or class given in Python; else `path`. `reward_fn`: scores the
        last reply when the agent returns None (command agents)."""
        from asyncrl.proxy.server import ProxyServer
        from asyncrl.proxy.workflow import AgentWorkflow
        from asyncrl.rollout.group import GroupedWorkflow

        agent = agent if agent is not None else self.path
        if agent is None:
            raise UserError("workflow.kind=agent needs workflow.path (package.module:AgentClass) "
                            "or an agent passed to Trainer.train(workflow=...)")
        try:
            proxy = ProxyServer(ctx.engine, ctx.tokenizer, self.proxy,
                                context_length=ctx.context_length, chat=ctx.chat,
                                vision=ctx.vision)
            inner = AgentWorkflow(agent, proxy, self, eval_concurrency=ctx.eval.concurrency,
                                  reward_fn=reward_fn)
        except ValueError as err:
            raise UserError(f"workflow.path: {err}") from err
        n = ctx.gconfig.n_samples
        return GroupedWorkflow(inner, n) if n > 1 else inner


class CommandWorkflowConfig(Config):
    """An agent that is a program (`argv`), run once per episode against the proxy: the session's
    OPENAI_/ANTHROPIC_ BASE_URL and API_KEY in its environment, the row as JSON on stdin, the
    reward on its last stdout line (a number, or a JSON object of completion ids) or, with
    `reward: reward_fn`, the run's reward on the session's last reply. Its process group is
    killed at the end, on timeout and on cancellation (asyncrl/proxy/command_agent.py)."""

    # the workflow (WORKFLOWS: rlvr | multi_turn | tool_calls | agent | command | agent_env | custom)
    kind: Literal["command"] = "command"
    argv: list[str] = pydantic.Field(min_length=1, description="the program and its arguments")
    env: dict[str, str] = {}  # more environment variables
    cwd: str | None = None  # working directory (None: the job's)
    # stdout: its last line; reward_fn: the run's reward on the session's last reply
    reward: Literal["stdout", "reward_fn"] = "stdout"
    max_output_bytes: int = pydantic.Field(1 << 20, ge=1)  # stdout or stderr; more: rejected
    limits: CommandLimits = CommandLimits()  # rlimits of the program and its children
    timeout_s: float = pydantic.Field(300.0, gt=0)  # one episode; longer: killed, rejected
    # an earlier completion's return is its reward plus this times the next one's return
    turn_discount: float = pydantic.Field(1.0, ge=0.0, le=1.0)
    # individual: one trajectory per completion; concat: one per episode
    export_style: Literal["individual", "concat"] = "individual"
    proxy: ProxyConfig = ProxyConfig()

    def build(self, ctx: WorkflowContext) -> RolloutWorkflow:
        from asyncrl.proxy.command_agent import CommandAgent

        agent = CommandAgent(self.argv, self.env, self.cwd, self.reward, self.max_output_bytes,
                             self.limits)
        cfg = AgentWorkflowConfig(timeout_s=self.timeout_s, turn_discount=self.turn_discount,
                                  export_style=self.export_style, proxy=self.proxy)
        reward_fn = _needs_reward(ctx, "command (reward: reward_fn)") \
            if self.reward == "reward_fn" else None
        return cfg.build(ctx, agent=agent, reward_fn=reward_fn)


class AgentEnvWorkflowConfig(AgentEnvConfig):
    """The documents' Agent + Environment: `agent` and `env` name classes (or factories) built
    once per episode, each with its kwargs plus the row (`data`) when its signature takes one.
    The env is a gymnasium-style Env (async reset/step, or gymnasium's own sync ones); each
    agent step that generated tokens is a sample, rewarded with the discounted return."""

    # the workflow (WORKFLOWS: rlvr | multi_turn | tool_calls | agent | command | agent_env | custom)
    kind: Literal["agent_env"] = "agent_env"
    agent: str = pydantic.Field(description="package.module:AgentClass")
    env: str = pydantic.Field(description="package.module:EnvClass")
    agent_kwargs: dict[str, Any] = {}  # keyword arguments of the agent class
    env_kwargs: dict[str, Any] = {}  # keyword arguments of the env class

    def build(self, ctx: WorkflowContext) -> RolloutWorkflow:
        from asyncrl.rollout.agent_env import AgentEnvWorkflow, per_episode
        from asyncrl.rollout.group import GroupedWorkflow

        agent_cls = import_object(self.agent, "workflow.agent")
        env_cls = import_object(self.env, "workflow.env")
        inner = AgentEnvWorkflow(
            per_episode(agent_cls, self.agent_kwargs, ctx.injectable(), "workflow.agent"),
            per_episode(env_cls, self.env_kwargs, ctx.injectable(), "workflow.env"),
            AgentEnvConfig(max_steps=self.max_steps, discount=self.discount))
        n = ctx.gconfig.n_samples
        return GroupedWorkflow(inner, n) if n > 1 else inner


class CustomWorkflowConfig(Config):
    """Your own workflow: `path: package.module:Name` names a class or factory, called with
    `kwargs` plus whichever of `tokenizer`, `gconfig`, `reward_fn`, `chat` (the model's chat
    options) its signature asks for, or an instance. It must give an object with
    `async def arun_episode(engine, data)` (a RolloutWorkflow) or an agent
    (`async def run(data, **kw)`, run through the proxy).
    `workflow: {path: ..., kwargs: ...}` without a kind means this one."""

    # the workflow (WORKFLOWS: rlvr | multi_turn | tool_calls | agent | command | agent_env | custom)
    kind: Literal["custom"] = "custom"
    path: str = pydantic.Field(description="package.module:ClassOrFactory")
    kwargs: dict[str, Any] = {}  # keyword arguments of the class or factory

    def build(self, ctx: WorkflowContext) -> RolloutWorkflow:
        made = make_from_path(self.path, self.kwargs, ctx, "workflow.path")
        agent_cfg = AgentWorkflowConfig(init_kwargs=self.kwargs if inspect.isclass(made) else {})
        return workflow_from_object(made, agent_cfg, ctx, "workflow.path")


WORKFLOWS: Registry = Registry("workflow",
                               infer_kind=lambda m: "custom" if "path" in m else None)
for _cls in (RLVRWorkflowConfig, MultiTurnWorkflowConfig, ToolCallingWorkflowConfig,
             AgentWorkflowConfig,
             CommandWorkflowConfig, AgentEnvWorkflowConfig, CustomWorkflowConfig):
    WORKFLOWS.register(_cls)

WorkflowConfig = WORKFLOWS.field()


def make_from_path(path: str, kwargs: dict[str, Any], ctx: WorkflowContext, what: str) -> Any:
    """The object `path` names; a class or factory is called with `kwargs` plus the context
    values its signature names and kwargs do not set (an agent class is left to the agent
    workflow, which instantiates it)."""
    target = import_object(path, what)
    if inspect.isclass(target) and _is_agent_class(target):
        return target
    if not inspect.isclass(target) and (isinstance(target, (RolloutWorkflow, Evaluator,
                                                             AgentProgram))
                                        or not callable(target)):
        return target  # an instance
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        params = {}
    extra = {k: v for k, v in ctx.injectable().items() if k in params and k not in kwargs}
    try:
        return target(**kwargs, **extra)
    except TypeError as err:
        raise UserError(f"{what}: calling {path!r} with kwargs {sorted(kwargs)} failed: "
                        f"{err}") from err


def _is_agent_class(cls: type) -> bool:
    return inspect.iscoroutinefunction(getattr(cls, "run", None))


def workflow_from_object(obj: Any, agent_cfg: AgentWorkflowConfig, ctx: WorkflowContext,
                         what: str = "workflow") -> RolloutWorkflow:
    """A RolloutWorkflow as it is; an agent (object or class) through `agent_cfg`."""
    if isinstance(obj, RolloutWorkflow):
        return obj
    if isinstance(obj, AgentProgram) or (inspect.isclass(obj) and _is_agent_class(obj)):
        return agent_cfg.build(ctx, agent=obj)
    raise UserError(f"{what} {obj!r}: expected a RolloutWorkflow (async def arun_episode) or an "
                    "agent (async def run); a reward function goes to Trainer.train(reward=...)")


def evaluator_for(eval_workflow: Any, workflow: RolloutWorkflow, ctx: WorkflowContext,
                  concurrency: int) -> Evaluator:
    """`eval_workflow` (an Evaluator, or a workflow; None: the training workflow), evaluated by
    its own `aevaluate`, else one episode per row (mean reward)."""
    from asyncrl.rollout.episode_eval import EpisodeEvaluator

    target = workflow if eval_workflow is None else eval_workflow
    if isinstance(target, Evaluator):
        return target
    return EpisodeEvaluator(workflow_from_object(target, AgentWorkflowConfig(), ctx,
                                                 "eval_workflow"), concurrency)
