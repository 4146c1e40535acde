"""The long-tailed chain-sum task (asyncrl/data/chain.py): worked solutions, the length tail, the
split, and how the warm start and the reward read its rows."""

import collections

import pytest

from asyncrl.config import ConfigError
from asyncrl.data.chain import ChainTaskConfig, solution
from asyncrl.data.dataset import DATASETS
from asyncrl.reward.exact import exact_answer_reward
from asyncrl.train.sft import reply_text, with_label_noise


def test_solution_by_hand():
    assert solution([7, 35, 12]) == ("7+35=42\n42+12=54", 54)
    assert solution([3, 4]) == ("3+4=7", 7)


def test_rows_lengths_have_a_long_tail_and_the_split_is_clean():
    task = DATASETS.parse({"kind": "chain", "num_train": 3000, "num_eval": 200}).build()
    train, held = task.train_rows(), task.eval_rows()
    assert len(train) == 3000 and len(held) == 200
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    terms = collections.Counter(r["terms"] for r in train)
    assert min(terms) == 2 and max(terms) == 12 and terms[2] > terms[4] > terms[8]
    lengths = sorted(len(reply_text(r)) for r in train)
    median, p95 = lengths[len(lengths) // 2], lengths[int(0.95 * len(lengths))]
    assert p95 >= 2.5 * median and lengths[-1] >= 4 * median  # a long tail
    for r in train[:50]:
        ops = [int(x) for x in r["question"].split("+")]
        assert r["terms"] == len(ops) and int(r["answer"]) == sum(ops)
        assert r["messages"][-1]["content"] == r["question"] + "="
        assert exact_answer_reward(reply_text(r), r["answer"]) == 1.0


def test_label_noise_shifts_the_final_answer_and_keeps_the_worked_lines():
    rows = ChainTaskConfig(num_train=200, num_eval=0).build().train_rows()
    noisy = with_label_noise(rows, 1.0, 1)
    for clean, bent in zip(rows, noisy):
        assert bent["solution"] == clean["solution"]
        assert int(bent["answer"]) == int(clean["answer"]) + 1
        assert exact_answer_reward(reply_text(bent), clean["answer"]) == 0.0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_terms"):
        ChainTaskConfig(min_terms=5, max_terms=3)
    with pytest.raises(ConfigError, match="distinct problems"):
        ChainTaskConfig(digits=1, min_terms=2, max_terms=2, num_train=200, num_eval=0).build()
