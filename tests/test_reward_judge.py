"""`reward: {kind: judge}`: reading scores from replies, and the judge as a real `asyncrl serve`
subprocess (through the `openai` client) and as the built-in engine in process, in training.

The tiny model's replies are random text, so the end-to-end tests stay deterministic with greedy
decoding and a `score_regex` + `labels` built from the reply the same judge gives directly."""

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from conftest import running_servers
from openai import AsyncOpenAI
from test_train_loop import small_config

from asyncrl import Trainer
from asyncrl.launch.judge_engine import engine_judge, open_run_reward
from asyncrl.reward.call import RewardError, call_reward
from asyncrl.reward.judge import JudgeReplyError, JudgeReward, judge_messages, parse_score
from asyncrl.reward.judge import JudgeRewardConfig
from asyncrl.reward.config import open_reward

pytestmark = pytest.mark.usefixtures("one_thread")

ROW = {"id": 5, "answer": "12", "messages": [{"role": "user", "content": "6+6?"}]}
TEMPLATE = "Q {question} A {answer} S {completion} ?"
WHOLE_REPLY = r"(?s)^(.*)$"  # the whole reply is the label


def judge_cfg(**over):
    return JudgeRewardConfig(**{"base_url": "http://127.0.0.1:1/v1", "model": "m", **over})


@pytest.mark.parametrize("reply,score", [
    ("Score: 7", 0.7), ("score=10.0 definitely", 1.0), ("Score: 14", 1.0), ("Score: -3", 0.0),
    ("I cannot say", None), ("Score: nan", None)])
def test_scores_are_read_scaled_and_clamped(reply, score):
    got = parse_score(reply, judge_cfg())
    assert got == (None if score is None else pytest.approx(score))


def test_yes_no_labels_and_the_template_filled_from_the_row():
    cfg = judge_cfg(score_regex=r"(?i)\b(yes|no)\b", labels={"yes": 1.0, "no": 0.0},
                    template=TEMPLATE, system_prompt="grade")
    assert parse_score("YES, it is", cfg) == 1.0 and parse_score("no", cfg) == 0.0
    assert judge_messages(cfg, "twelve", ROW) == [
        {"role": "system", "content": "grade"},
        {"role": "user", "content": "Q 6+6? A 12 S twelve ?"}]


class Canned:
    """A JudgeClient that answers from a list (the unparseable-reply paths, no model needed)."""

    def __init__(self, reply):
        self.reply = reply

    async def complete(self, messages, cfg):
        return self.reply


def test_an_unparseable_reply_is_an_error_or_a_counted_zero_never_a_silent_one(caplog):
    with pytest.raises(RewardError, match="judge reply 'no idea' has no score") as err:
        asyncio.run(call_reward(JudgeReward(judge_cfg(), Canned("no idea")), "x", ROW))
    assert isinstance(err.value.__cause__, JudgeReplyError)
    zero = JudgeReward(judge_cfg(on_unparseable="zero"), Canned("no idea"))
    assert asyncio.run(zero("x", ROW)) == 0.0
    assert zero.stats().unparseable == 1 and "no idea" in caplog.text
    assert zero.metrics()["reward/judge_unparseable"] == 1.0


async def served_reply(url, cfg):
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY")
    resp = await client.chat.completions.create(
        model=cfg.model, messages=judge_messages(cfg, "12", ROW), max_tokens=cfg.max_tokens,
        temperature=0.0)
    return resp.choices[0].message.content


def test_judge_on_a_real_asyncrl_serve_subprocess(model_dir):
    with running_servers(model_dir, 1) as [(url, _)]:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        base = {"kind": "judge", "base_url": f"{url}/v1", "model": model, "template": TEMPLATE,
                "max_tokens": 6, "score_regex": WHOLE_REPLY}
        reply = asyncio.run(served_reply(url, JudgeRewardConfig(**base)))
        label = reply.strip().lower()
        with open_reward({**base, "labels": {label: 0.25}}) as reward:
            async def three():
                return await asyncio.gather(*(call_reward(reward, "12", ROW) for _ in range(3)))

            scores = asyncio.run(three())
        assert scores == [0.25] * 3  # greedy: the reply the server gave directly, every time
        with open_reward({**base, "labels": {label + "#": 0.25}}) as reward:
            expected = parse_score(reply, JudgeRewardConfig(**base))  # only if it is a number
            if expected is None:
                with pytest.raises(RewardError, match="has no score"):
                    asyncio.run(call_reward(reward, "12", ROW))
            else:
                assert asyncio.run(call_reward(reward, "12", ROW)) == expected


def test_judge_on_the_built_in_engine_in_process(model_dir):
    cfg = JudgeRewardConfig(model_path=str(model_dir), template=TEMPLATE, max_tokens=6,
                            score_regex=WHOLE_REPLY, max_concurrency=2)
    with engine_judge(cfg) as client:
        reply = asyncio.run(client.complete(judge_messages(cfg, "12", ROW), cfg))
        labelled = cfg.model_copy(update={"labels": {reply.strip().lower(): 0.75}})
        reward = JudgeReward(labelled, client)
        assert asyncio.run(call_reward(reward, "12", ROW)) == 0.75
    with pytest.raises(ValueError, match="asyncrl.launch.judge_engine.open_run_reward"):
        with open_reward(cfg.to_dict()):
            pass


def test_asyncrl_train_with_a_judge_reward(model_dir, tmp_path):
    """The real training path: every sample of 2 steps scored by the in-process judge engine;
    `(?s)^()` reads an empty label from any reply, so every reward is the label's 0.5."""
    judge = {"kind": "judge", "model_path": str(model_dir), "template": TEMPLATE,
             "max_tokens": 2, "score_regex": "(?s)^()", "labels": {"": 0.5}}
    cfg = small_config(model_dir, tmp_path / "run", **{"total_steps": 2, "eval.every": 0,
                                                       "reward": judge})
    result = Trainer(cfg).train()
    assert result.steps == 2
    lines = (Path(tmp_path / "run") / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if "reward/mean" in m]
    assert [m["reward/mean"] for m in steps] == [0.5, 0.5]
    # the judge's counts reach metrics.jsonl: a call per scored sample, none unparseable
    calls = [m["reward/judge_calls"] for m in steps]
    assert 0 < calls[0] <= calls[1] and steps[0]["reward/judge_latency_s"] > 0
    assert all(m["reward/judge_unparseable"] == 0 for m in steps)


def test_eval_with_a_judge_reward(model_dir, tmp_path):
    from asyncrl.launch.evaluate import run_eval_job
    from asyncrl.rollout.answer_eval import EvalConfig

    judge = {"kind": "judge", "model_path": str(model_dir), "max_tokens": 2,
             "template": TEMPLATE, "score_regex": "(?s)^()", "labels": {"": 1.0}}
    result = run_eval_job(model_dir, "arithmetic", EvalConfig(max_new_tokens=4), reward=judge,
                          limit=3, max_num_seqs=4, num_threads=1)
    assert result.greedy_accuracy == 1.0
    assert open_run_reward("exact") is not None
