"""The one discount recursion (asyncrl.reward.returns) and the light import of asyncrl.reward."""

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.reward.returns import discounted_returns, session_returns, turn_returns

REWARD = st.floats(-10, 10, allow_nan=False)


def test_turn_returns_by_hand():
    # turn 2: [1, 3] (mean 2); turn 1: [0 + 0.5*2] = [1]; turn 0: [2 + 0.5*1] = [2.5]
    assert turn_returns([[2.0], [0.0], [1.0, 3.0]], 0.5) == [[2.5], [1.0], [1.0, 3.0]]


def test_an_empty_turn_passes_the_next_mean_through():
    assert turn_returns([[1.0], [], [2.0]], 0.5) == [[2.0], [], [2.0]]
    assert turn_returns([], 0.9) == []


def test_discounted_returns_one_reply_per_turn():
    assert discounted_returns([0.0, 0.0, 1.0], 0.9) == pytest.approx([0.81, 0.9, 1.0])
    assert discounted_returns([1.0, -1.0], 0.0) == [1.0, -1.0]
    assert discounted_returns([], 0.5) == []


@given(st.lists(REWARD, max_size=6), st.floats(0, 1))
def test_workflow_and_session_returns_agree_on_one_choice_turns(rewards, discount):
    ids = [f"c{i}" for i in range(len(rewards))]
    by_id = session_returns([[cid] for cid in ids], dict(zip(ids, rewards)), discount)
    assert [by_id[cid] for cid in ids] == discounted_returns(rewards, discount)
    # the recursion written out directly, as the workflows had it
    want = list(rewards)
    for i in reversed(range(len(want) - 1)):
        want[i] += discount * want[i + 1]
    assert discounted_returns(rewards, discount) == want


def test_reward_modules_import_without_torch():
    code = ("import sys, asyncrl.reward, asyncrl.reward.call, asyncrl.reward.config, "
            "asyncrl.reward.returns\n"
            "print(','.join(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"asyncrl.reward imported {out.stdout.strip()}"
