"""Rewards by name and config: sync user functions off the event loop, errors with context, the
TRL batched adapter with TRL's own reward functions, the `code` reward in the real sandbox, and
the one-line errors of bad specs. Real thread and process pools, real sandboxes; no mocks."""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import reward_plugins
from test_reward_sandbox import needs_isolation

from asyncrl.config import ConfigError
from asyncrl.launch.train_config import TrainRunConfig
from asyncrl.reward.call import RewardError, call_reward, call_rewards, inline, is_inline
from asyncrl.reward.config import reward_spec_from_cli
from asyncrl.reward.config import open_reward

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_reward_offloop import with_heartbeat  # noqa: E402  (the benchmark's own meter)

ROW = {"id": 7, "answer": "12", "messages": [{"role": "user", "content": "6+6?"}]}


def test_slow_sync_reward_runs_off_the_loop_and_overlaps():
    with open_reward("reward_plugins:slow_reward") as reward:
        async def four_rollouts():
            return await asyncio.gather(*(call_reward(reward, c, ROW)
                                          for c in ("12", "13", "12", "x")))

        scores, elapsed, worst_gap = asyncio.run(with_heartbeat(four_rollouts()))
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert elapsed < 1.6, f"4 x 0.5 s on 8 threads took {elapsed:.2f}s: not concurrent"
    # under the 0.5 s stall of the control below, with room for a busy machine's scheduling
    assert worst_gap < 0.4, f"the event loop stalled for {worst_gap:.2f}s"


def test_the_heartbeat_sees_a_reward_marked_inline_stall_the_loop():
    """The control for the test above: the same function called on the loop stalls it."""
    on_loop = inline(lambda c, row: reward_plugins.slow_reward(c, row))
    _, _, worst_gap = asyncio.run(with_heartbeat(call_reward(on_loop, "12", ROW)))
    assert worst_gap >= 0.45


def test_only_the_cheap_built_ins_run_on_the_loop():
    """exact and digits stay inline, so the default job's rollouts run as before this change."""
    for name in ("exact", "digits"):
        with open_reward(name) as reward:
            assert is_inline(reward) and reward("#### 12", ROW) == 1.0
    with open_reward("reward_plugins:slow_reward") as reward:
        assert not is_inline(reward)


def test_plain_sync_function_objects_also_run_off_the_loop():
    scores, _, worst_gap = asyncio.run(with_heartbeat(
        call_rewards(reward_plugins.slow_reward, ["12", "1"], ROW)))
    assert scores == [1.0, 0.0] and worst_gap < 0.4


@pytest.mark.parametrize("spec", ["reward_plugins:raising_reward",
                                  {"kind": "function", "path": "reward_plugins:raising_reward",
                                   "executor": "process", "max_workers": 1}])
def test_reward_errors_propagate_with_the_reward_and_the_row(spec):
    with open_reward(spec) as reward:
        with pytest.raises(RewardError, match=r"raising_reward.*id=7") as err:
            asyncio.run(call_reward(reward, "oops", ROW))
    assert "cannot score 'oops'" in str(err.value) + str(err.value.__cause__)


def test_process_executor_runs_in_a_worker_main_thread():
    spec = {"kind": "function", "path": "reward_plugins:main_thread_reward",
            "executor": "process", "max_workers": 1}
    with open_reward(spec) as reward:
        assert asyncio.run(call_reward(reward, "x", ROW)) == 1.0
    with open_reward("reward_plugins:main_thread_reward") as reward:  # thread pool: not main
        assert asyncio.run(call_reward(reward, "x", ROW)) == 0.0


def test_non_numeric_scores_are_errors_not_zero():
    with pytest.raises(RewardError, match="returned None on row id=7"):
        asyncio.run(call_reward(lambda c, row: None, "x", ROW))


# ---- TRL adapter ---------------------------------------------------------------------------

def test_trl_function_scores_a_whole_group_in_one_call():
    row = {**ROW, "solution": "12"}
    reward_plugins.BATCHES.clear()
    with open_reward("trl:reward_plugins:trl_style_reward") as reward:
        scores = asyncio.run(call_rewards(reward, ["12", "13", "12"], row, [[1, 2], [3], [4]]))
        assert asyncio.run(call_reward(reward, "12", row)) == pytest.approx(1.0)  # eval: one
    assert scores == pytest.approx([1.02, 0.01, 1.01])
    assert reward_plugins.BATCHES == [3, 1]


def test_trl_library_reward_functions_work_unchanged():
    pytest.importorskip("trl", reason="TRL is the optional peer (pip install asyncrl[bench])")
    spec = {"kind": "trl", "functions": ["trl.rewards:think_format_reward",
                                         "reward_plugins:length_penalty"], "weights": [1.0, 0.5]}
    with open_reward(spec) as reward:
        scores = asyncio.run(call_rewards(reward, ["<think>hm</think>12", "12"], ROW))
    # think_format_reward: 1 for the first, 0 for the second; plus 0.5 * -0.1 per character
    assert scores == pytest.approx([1.0 - 0.05 * 19, 0.0 - 0.05 * 2])


def test_trl_none_for_every_function_is_an_error_naming_the_row():
    row = {**ROW, "solution": None}
    with open_reward("trl:reward_plugins:trl_style_reward") as reward:
        with pytest.raises(RewardError, match="returned None for completion 0 of row id=7"):
            asyncio.run(call_rewards(reward, ["12"], row, [[1]]))


# ---- code ------------------------------------------------------------------------------------

CODE_ROW = {"id": 3, "tests": [{"input": "2 3\n", "output": "5\n"},
                               {"input": "10 -4\n", "output": "6"}]}
ADD = "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"


@needs_isolation
def test_code_reward_passes_fails_and_times_out_a_hostile_program():
    spec = {"kind": "code", "limits": {"wall_seconds": 2}}  # the wall limit ends the loop
    with open_reward(spec) as reward:
        assert asyncio.run(reward(ADD, CODE_ROW)) == 1.0
        assert asyncio.run(reward(ADD.replace("a + b", "a * b"), CODE_ROW)) == 0.0
        start = time.monotonic()
        assert asyncio.run(reward("```python\nwhile True:\n    pass\n```", CODE_ROW)) == 0.0
        assert time.monotonic() - start < 8
        assert dict(reward.outcomes) == {"passed": 1, "wrong output": 1, "timeout": 1}


@needs_isolation
def test_code_reward_by_name_reads_apps_style_input_output():
    row = {"id": 4, "input_output": '{"inputs": ["2 3\\n"], "outputs": ["5\\n"]}'}
    with open_reward("code") as reward:
        with pytest.raises(RewardError, match="no 'tests' field"):
            asyncio.run(call_reward(reward, ADD, row))
    with open_reward({"kind": "code", "tests_field": "input_output"}) as reward:
        assert asyncio.run(call_reward(reward, ADD, row)) == 1.0


# ---- specs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,words", [
    ("nope", "unknown; allowed: exact, digits, clevr_count_70k, math, function, trl, code, judge"),
    ("judge", "judge needs exactly one of base_url .* or model_path"),
    ({"kind": "judge", "base_url": "http://x/v1", "model": "m",
      "template": "{qestion} {completion}"},
     r"placeholders \['qestion'\] are unknown; allowed: \{question\}, \{answer\}, \{completion\}"),
    ({"kind": "judge", "model_path": "/m", "score_regex": "[0-9]+"}, "has no group"),
    ({"kind": "trl", "functions": ["a:b"], "weights": [1, 2]}, "one per function"),
    ({"kind": "function", "path": "a:b", "executor": "fork"}, "executor='fork'"),
])
def test_bad_reward_specs_fail_at_config_load_in_one_line(spec, words):
    with pytest.raises(ConfigError, match=words) as err:
        TrainRunConfig.from_dict({"reward": spec})
    assert "\n" not in str(err.value)


def test_string_rewards_are_shorthands_and_eval_takes_inline_mappings(tmp_path):
    reward = TrainRunConfig.from_dict({"reward": "trl:reward_plugins:length_penalty"}).reward
    assert (reward.kind, reward.functions) == ("trl", ["reward_plugins:length_penalty"])
    reward = TrainRunConfig.from_dict({"reward": "reward_plugins:slow_reward"}).reward
    assert (reward.kind, reward.path) == ("function", "reward_plugins:slow_reward")
    assert reward_spec_from_cli("{kind: code, tests_field: io}") == {"kind": "code",
                                                                     "tests_field": "io"}
    path = tmp_path / "judge.yaml"
    path.write_text("reward:\n  kind: judge\n  base_url: http://x/v1\n  model: m\n")
    assert reward_spec_from_cli(str(path))["kind"] == "judge"
    with pytest.raises(ConfigError, match="unknown"):
        reward_spec_from_cli("exactt")


def eval_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))  # reward_plugins importable
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "eval", *map(str, args)],
                          capture_output=True, text=True, timeout=300, check=False, env=env)


@pytest.mark.slow
def test_asyncrl_eval_scores_with_a_trl_reward_and_refuses_bad_specs(model_dir, tmp_path):
    out = tmp_path / "eval.json"
    proc = eval_cli(model_dir, "--data", "arithmetic", "--limit", "3", "--max-new-tokens", "4",
                    "--reward", "trl:reward_plugins:length_penalty", "--json", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    problems = json.loads(out.read_text())["problems"]
    assert len(problems) == 3
    for p in problems:  # the adapter's score of exactly the text the eval generated
        assert p["greedy_reward"] == pytest.approx(-0.1 * len(p["greedy_completion"]))
    proc = eval_cli(model_dir, "--data", "arithmetic", "--reward", "{kind: judge, model: m}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "needs exactly one of base_url" in lines[0]
