"""Math-answer reward through math_verify: answer extraction, equivalence, timeouts, threads."""

from __future__ import annotations

import threading
import time

import pytest

from asyncrl.reward.math_verify import (
    math_answer_reward,
    parse_prediction,
    parse_reference,
)


@pytest.mark.parametrize("response, answer", [
    ("so the probability is \\boxed{1/2}", "0.5"),
    ("The answer is $\\frac{1}{2}$.", "0.5"),
    ("\\boxed{0.75}", "\\dfrac{3}{4}"),
    ("\\boxed{\\frac{3}{4}}", "\\frac34"),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}"),
    ("She sold 48/2 = 24 clips, 48+24 = 72 in total.\n#### 72", "72"),
    ("####72", "72"),
    ("#### 1,000", "1000"),
    ("we get 12 first and finally 7 apples", "7"),  # no marker, no box: the last number
    ("x is \\boxed{3}, not 5", "3"),  # the box beats the last number
    # A GSM8K reference is a whole solution; only its final answer counts.
    ("#### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"),
])
def test_equivalent_answers_score_one(response, answer):
    assert math_answer_reward(response, answer) == 1.0


@pytest.mark.parametrize("response, answer", [
    ("\\boxed{2}", "3"),
    ("I used 72 then 71.\n#### 71", "72"),  # the marked answer counts, not an earlier 72
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("no answer at all", "3"),
    ("", "3"),
])
def test_wrong_or_missing_answers_score_zero(response, answer):
    assert math_answer_reward(response, answer) == 0.0


def test_parsers_return_sympy_values():
    assert str(parse_reference("\\frac{1}{2}")[0]) == "1/2"
    assert str(parse_prediction("first 3 #### 4")[0]) == "4"


def test_unparseable_reference_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="answer="):
        math_answer_reward("\\boxed{1}", "")


def test_timeout_must_be_whole_seconds():
    with pytest.raises(ValueError, match="timeout_seconds=0"):
        math_answer_reward("\\boxed{1}", "1", timeout_seconds=0)


def test_heavy_expression_is_cut_by_math_verify_alarm():
    # In a main thread math_verify's SIGALRM bounds each step; the pool test covers the rest.
    start = time.monotonic()
    assert math_answer_reward("\\boxed{(x+1)^{10000000}}", "1", timeout_seconds=1) == 0.0
    assert time.monotonic() - start < 3.0


def test_refuses_to_run_off_the_main_thread():
    errors = []

    def call():
        try:
            math_answer_reward("\\boxed{1}", "1")
        except RuntimeError as err:
            errors.append(str(err))

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert errors and "RewardPool" in errors[0]
