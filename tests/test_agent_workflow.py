"""Agent programs as rollouts: AgentWorkflow through the real rollout executor, the real proxy
over HTTP and the real built-in engine with the tiny model; inline and subprocess modes, rewards
as floats and dicts, and broken agents rejected with a logged reason while the others go on."""

import logging

import pytest

from asyncrl.api import Trajectory
from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.models.chat import encode_chat_prompt
from asyncrl.models.loading import load_tokenizer
from asyncrl.proxy.agent_runner import check_result, load_agent
from asyncrl.proxy.config import AgentConfig, ProxyConfig
from asyncrl.proxy.server import ProxyServer
from asyncrl.proxy.workflow import AgentWorkflow
from asyncrl.rollout.executor import RolloutConfig, WorkflowExecutor
from tests import agents_for_tests as agents
from conftest import run_episodes

ROWS = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)}
        for i in range(4)]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, one_thread):
    eng = AsyncLLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=256))
    yield eng
    eng.shutdown()


def run_rows(engine, tokenizer, agent, rows=ROWS, **cfg):
    proxy_cfg = ProxyConfig(admin_key="admin", max_tokens_cap=128)
    workflow = AgentWorkflow(agent, ProxyServer(engine, tokenizer, proxy_cfg, context_length=256),
                             AgentConfig(**cfg))
    with WorkflowExecutor(engine, RolloutConfig(batch_size=len(rows)), workflow) as ex:
        trajs = run_episodes(ex, rows)
        stats = ex.stats()
        ex.run(workflow.aclose())
    return trajs, stats, workflow


def test_inline_agent_by_dotted_path(engine, tokenizer):
    trajs, stats, _ = run_rows(engine, tokenizer, "tests.agents_for_tests:OneShotAgent")
    assert stats["accepted"] == 4 and len(trajs) == 4
    for traj in trajs:
        assert isinstance(traj, Trajectory) and len(traj.samples) == 1
        smp = traj.samples[0]
        assert smp.reward == 1.0 and 1 <= smp.num_generated <= 4
        row = next(r for r in ROWS if r["id"] == traj.group_id)
        prompt = encode_chat_prompt(tokenizer, row["messages"])
        assert smp.input_ids[:len(prompt)] == prompt


def test_dict_rewards_discounted_and_exported_both_ways(engine, tokenizer):
    # r = (0.5, 0, 1.0), discount 0.5: returns = (0.5 + 0.5*0.5, 0 + 0.5*1, 1) = (0.75, 0.5, 1)
    agent = agents.ThreeTurnAgent(first=0.5, last=1.0)
    trajs, _, _ = run_rows(engine, tokenizer, agent, ROWS[:1], turn_discount=0.5)
    assert [s.reward for s in trajs[0].samples] == pytest.approx([0.75, 0.5, 1.0])
    s0, s1, s2 = trajs[0].samples
    assert s1.input_ids[:len(s0.input_ids)] == s0.input_ids  # turn 2 continues turn 1's tokens
    assert s2.input_ids[:len(s1.input_ids)] == s1.input_ids
    trajs, _, _ = run_rows(engine, tokenizer, agents.ThreeTurnAgent, ROWS[:1], turn_discount=0.5,
                           export_style="concat")
    (only,) = trajs[0].samples
    assert only.reward == pytest.approx(0.75) and only.metadata["turns"] == 3
    assert only.num_generated == sum(1 for m in only.loss_mask if m)
    nonzero = [r for r in only.token_rewards if r]
    assert nonzero == [0.5, 1.0]


def test_subprocess_agent_with_env_configured_sync_client(engine, tokenizer):
    trajs, stats, _ = run_rows(engine, tokenizer, agents.SyncEnvAgent(), ROWS[:2],
                               mode="subproc", subproc_max_workers=2)
    assert stats["accepted"] == 2
    assert [t.samples[0].reward for t in trajs] == [0.25, 0.25]


def test_raising_hanging_and_wrong_agents_are_rejected_with_reasons(engine, tokenizer, caplog):
    caplog.set_level(logging.WARNING, logger="asyncrl.rollout.executor")
    cases = [(agents.RaisingAgent, {}, "error", "tool server unreachable"),
             (agents.HangingAgent, {"timeout_s": 0.5}, "timeout", "timeout_s=0.5"),
             (agents.WrongTypeAgent, {}, "error", "allowed: float or dict")]
    for agent, cfg, kind, reason in cases:
        trajs, stats, wf = run_rows(engine, tokenizer, agent, ROWS[:2], **cfg)
        assert trajs == [] and stats["rejected"] == 2 and wf.rejections[kind] == 2
        assert reason in caplog.text  # logged once in full by the executor, then summarised
        assert wf.proxy.store.active == 0  # no session left behind


def test_blocked_subprocess_is_killed_and_the_pool_goes_on(engine, tokenizer, caplog):
    caplog.set_level(logging.WARNING, logger="asyncrl.rollout.executor")
    cfg = AgentConfig(mode="subproc", subproc_max_workers=1, timeout_s=3.0)

    def proxy():
        return ProxyServer(engine, tokenizer, ProxyConfig(admin_key="a"), context_length=256)

    blocked = AgentWorkflow(agents.BlockingAgent(), proxy(), cfg)
    # the blocked agent's 3 s is its kill; the fine one gets room for a busy machine
    fine = AgentWorkflow(agents.SyncEnvAgent(), proxy(), cfg.model_copy(update={"timeout_s": 60.0}))
    fine.runner._pool = blocked.runner.pool()  # one shared single-worker pool
    with WorkflowExecutor(engine, RolloutConfig(batch_size=1), blocked) as ex:
        assert run_episodes(ex, ROWS[:1]) == []
        assert "timeout_s=3.0" in caplog.text
        ex.run(blocked.proxy.stop())
    with WorkflowExecutor(engine, RolloutConfig(batch_size=1), fine) as ex:
        (traj,) = run_episodes(ex, ROWS[1:2])  # the killed worker was replaced
        assert traj.samples[0].reward == 0.25
        blocked.runner.close_pool()
        fine.runner._pool = None
        ex.run(fine.proxy.stop())


def test_agent_specs_and_results_are_checked():
    assert isinstance(load_agent("tests.agents_for_tests.OneShotAgent"), agents.OneShotAgent)
    obj = agents.ThreeTurnAgent(0.1)
    assert load_agent(obj) is obj
    assert load_agent(agents.ThreeTurnAgent, {"first": 0.2}).first == 0.2
    with pytest.raises(ValueError, match="must define `async def run"):
        load_agent(agents.NotAnAgent)
    with pytest.raises(Exception, match="has no 'Nope'"):
        load_agent("tests.agents_for_tests:Nope")
    assert check_result(1) == 1.0 and check_result({"a": 1}) == {"a": 1.0}
    assert check_result(None) is None  # the workflow's reward_fn scores the session
    for bad in (True, "1", {"a": "x"}, {1: 1.0}):
        with pytest.raises(TypeError, match="allowed"):
            check_result(bad)


def test_agents_sdk_agent_runs_unchanged_through_the_proxy(engine, tokenizer):
    pytest.importorskip("agents")
    from examples.agents_sdk.agent import AgentsSDKMathAgent

    trajs, stats, _ = run_rows(engine, tokenizer, AgentsSDKMathAgent(), ROWS[:2])
    assert stats["accepted"] == 2
    assert all(t.samples[0].reward in (0.0, 1.0) for t in trajs)


def test_agents_sdk_tool_loop_is_recorded_as_one_conversation(tokenizer):
    """Scripted replies (the untrained model never calls tools): the SDK executes `calc`
    from the proxy's parsed tool call and sends the result back; concat export holds both turns."""
    pytest.importorskip("agents")
    from examples.agents_sdk.agent import AgentsSDKMathAgent
    from tests.proxy_helpers import ScriptedEngine

    replies = ['<tool_call>{"name":"calc","arguments":{"expr":"2+3"}}</tool_call>', "5"]
    scripted = ScriptedEngine(tokenizer, replies)
    agent = AgentsSDKMathAgent(use_calculator=True, max_tokens=100)
    trajs, stats, _ = run_rows(scripted, tokenizer, agent, [{**ROWS[0], "answer": "5"}],
                               export_style="concat", turn_discount=0.9)
    (traj,) = trajs
    (smp,) = traj.samples
    # reward 1.0 on the answer; the path's return from the first turn is 0 + 0.9 * 1.0
    assert smp.reward == pytest.approx(0.9) and smp.metadata["turns"] == 2
    assert smp.metadata["tool_calls"] == 1
    text = tokenizer.decode(smp.input_ids)
    assert "<|im_start|>tool\n5<|im_end|>" in text  # the SDK ran the tool on the parsed call
    assert scripted.requests[1].input_ids[:len(scripted.requests[0].input_ids)] == \
        scripted.requests[0].input_ids


def test_example_agents_run_through_the_proxy(engine, tokenizer):
    from examples.math_agent.agent import MathAgent
    from examples.retry_agent.agent import RetryAgent

    trajs, stats, _ = run_rows(engine, tokenizer, MathAgent(), ROWS[:2])
    assert stats["accepted"] == 2
    trajs, stats, _ = run_rows(engine, tokenizer, RetryAgent(max_turns=2), ROWS[:2],
                               export_style="concat", turn_discount=0.5)
    assert stats["accepted"] == 2 and all(len(t.samples) == 1 for t in trajs)


def test_calculator_agent_scores_the_tool_result(tokenizer):
    from examples.tool_agent.agent import CalculatorAgent
    from tests.proxy_helpers import ScriptedEngine

    replies = ['<tool_call>{"name":"calc","arguments":{"expr":"37*45"}}</tool_call>', "1665",
               "1666"]  # a correct tool episode, then a wrong direct guess
    row = {"id": "m", "messages": [{"role": "user", "content": "37*45=?"}], "answer": "1665"}
    trajs, _, _ = run_rows(ScriptedEngine(tokenizer, replies), tokenizer, CalculatorAgent(),
                           [row], export_style="concat")
    (smp,) = trajs[0].samples
    assert smp.reward == 1.0 and smp.metadata["tool_calls"] == 1
    assert "<|im_start|>tool\n1665<|im_end|>" in tokenizer.decode(smp.input_ids)
    trajs, _, _ = run_rows(ScriptedEngine(tokenizer, ["1666"]), tokenizer, CalculatorAgent(),
                           [row], export_style="concat")
    assert trajs[0].samples[0].reward == 0.0 and trajs[0].samples[0].metadata["tool_calls"] == 0


def _langchain():
    try:
        import langchain_openai  # noqa: F401
    except ImportError:
        import os

        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            raise
        pytest.skip("LangChain is an optional extra: pip install -e '.[agents]'")


def test_langchain_tool_agent_runs_unchanged_through_the_proxy(tokenizer):
    """LangChain's ChatOpenAI with a bound tool (examples/langchain_agent): the tool call comes
    back parsed, LangChain runs it and sends the ToolMessage, and the two turns are recorded
    as one conversation (scripted replies: the untrained model never calls tools)."""
    _langchain()
    from examples.langchain_agent.agent import LangChainMathAgent
    from tests.proxy_helpers import ScriptedEngine

    replies = ['<tool_call>{"name":"calc","arguments":{"expr":"2+3"}}</tool_call>', "5"]
    scripted = ScriptedEngine(tokenizer, replies)
    trajs, stats, _ = run_rows(scripted, tokenizer, LangChainMathAgent(max_tokens=100),
                               [{**ROWS[0], "answer": "5"}], export_style="concat")
    (smp,) = trajs[0].samples
    assert smp.reward == 1.0 and smp.metadata["turns"] == 2 and smp.metadata["tool_calls"] == 1
    assert "<|im_start|>tool\n5<|im_end|>" in tokenizer.decode(smp.input_ids)


def test_langchain_agent_on_the_real_engine(engine, tokenizer):
    _langchain()
    from examples.langchain_agent.agent import LangChainMathAgent

    trajs, stats, _ = run_rows(engine, tokenizer, LangChainMathAgent(), ROWS[:2])
    assert stats["accepted"] == 2 and all(t.samples[0].reward in (0.0, 1.0) for t in trajs)
