"""Exact-answer reward: final-answer extraction and numeric comparison."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.reward import exact_answer_reward, extract_final_answer
from asyncrl.reward.exact import count_answer_reward


@pytest.mark.parametrize("text, expected", [
    ("3 + 4 = 7\n#### 7", "7"),
    ("#### 12 then 13 #### 14", "14"),  # the last marker wins
    ("She pays 1,234 then 20. #### 1,254 dollars", "1254"),
    ("####-5", "-5"),
    ("####  Paris \nexplanation", "Paris"),
    ("12+34=46", "46"),
    ("first 3, then 10, finally 99.", "99"),
    ("The temperature is -12 degrees", "-12"),
    ("50-4", "4"),  # a minus between digits is an operator, not a sign
    ("pi is about 3.14.", "3.14"),
    ("total: 1,000,000", "1000000"),
    ("items 1,2", "2"),  # not a thousands group
    ("no digits here", None),
    ("", None),
    ("####", None),
    ("#### \n", None),
])
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize("response, answer, reward", [
    ("46", "46", 1.0),
    ("46.0", "46", 1.0),
    ("#### 46.00", "46.0", 1.0),
    ("The answer is 1,000.", "1000", 1.0),
    ("#### 1000", "1,000", 1.0),
    ("-7", "-7", 1.0),
    ("7", "-7", 0.0),
    ("45", "46", 0.0),
    ("46.0000001", "46", 0.0),
    ("so 46 #### 47", "46", 0.0),  # the marked answer counts, not an earlier number
    ("", "46", 0.0),
    ("I don't know", "46", 0.0),
    ("#### Paris", "Paris", 1.0),
    ("#### London", "Paris", 0.0),
    ("nan", "nan", 0.0),  # no number and no marker: nothing was answered
])
def test_exact_answer_reward(response, answer, reward):
    assert exact_answer_reward(response, answer) == reward


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-10**12, max_value=10**12), st.booleans())
def test_roundtrip_any_integer(n, commas):
    shown = f"{n:,}" if commas else str(n)
    assert extract_final_answer(f"work work\n#### {shown}") == str(n)
    assert extract_final_answer(f"so the result is {shown}.") == str(n)
    assert exact_answer_reward(f"#### {shown}", str(n)) == 1.0
    assert exact_answer_reward(f"#### {n + 1}", str(n)) == 0.0


def test_digit_match_reward_partial_credit():
    from asyncrl.reward.exact import digit_match_reward

    assert digit_match_reward("167", "167") == 1.0
    assert digit_match_reward("the sum is 167.0", "167") == 1.0
    assert digit_match_reward("165", "167") == pytest.approx(0.5 * 2 / 3)  # units digit wrong
    assert digit_match_reward("67", "167") == pytest.approx(0.5 * 2 / 3)  # missing hundreds
    assert digit_match_reward("1167", "167") == pytest.approx(0.5 * 3 / 4)
    assert digit_match_reward("761", "167") == pytest.approx(0.5 * 1 / 3)
    assert digit_match_reward("no number", "167") == 0.0
    assert digit_match_reward("-167", "167") == 0.0
    assert digit_match_reward("#### Paris", "Paris") == 1.0
    assert digit_match_reward("#### Rome", "Paris") == 0.0
    assert digit_match_reward("165", "167", partial_weight=0.0) == 0.0


@pytest.mark.parametrize("response,answer,reward", [
    ("There are [3] objects.", "3", 1.0),
    ("[2] ... no, [3]", "3", 1.0),   # the last bracketed number
    ("[2] or 3", "3", 0.0),          # a bracketed answer wins over a later bare number
    ("3", "3", 1.0),                 # no brackets: the final number
    ("3.0", "3", 1.0),
    ("none", "3", 0.0),
])
def test_count_answer_reward_reads_the_bracketed_count(response, answer, reward):
    assert count_answer_reward(response, answer) == reward


def test_clevr_count_70k_is_a_reward_by_name():
    from asyncrl.reward.config import open_reward

    with open_reward("clevr_count_70k") as reward:
        assert reward("I count [4].", {"answer": "4"}) == 1.0
