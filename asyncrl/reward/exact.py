"""Exact-answer reward: 1.0 when a response's final answer equals the reference, else 0.0.

The final answer is what follows the last "####" (the GSM8K convention the prompts ask for) or,
without a marker, the last number in the text. Numbers compare by exact decimal value (not float),
so "46" equals "46.0" and "1,000" equals "1000.00", while "46" and "46.0000001" differ. A
non-numeric reference ("Paris") is compared as stripped text.
"""

from __future__ import annotations

import re
from decimal import Decimal

MARKER = "####"

# A sign only counts when it does not follow a digit ("50-4" ends in 4, not -4); thousands groups
# must be exactly three digits, so "1,2" is two numbers and "1,234" one.
NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
FULL_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_final_answer(text: str) -> str | None:
    """The response's final answer with thousands commas removed, or None when it gives none."""
    if MARKER in text:
        tail = text.rpartition(MARKER)[2]
        match = NUMBER.search(tail)
        if match:
            return match.group().replace(",", "")
        # A non-numeric final answer ("#### Paris"): the rest of that line.
        first_line = tail.strip().split("\n", 1)[0].strip()
        return first_line or None
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def as_number(text: str) -> Decimal | None:
    text = text.strip()
    # Decimal() alone would also accept "nan", "1e5" and "Infinity"; only plain numbers count.
    return Decimal(text.replace(",", "")) if FULL_NUMBER.fullmatch(text) else None


def exact_answer_reward(response: str, answer: str) -> float:
    """1.0 if the final answer in `response` equals `answer` (numerically when both are numbers)."""
    predicted = extract_final_answer(response)
    if predicted is None:
        return 0.0
    reference = str(answer).strip()
    want, got = as_number(reference), as_number(predicted)
    if want is not None and got is not None:
        return 1.0 if want == got else 0.0
    return 1.0 if predicted.strip() == reference else 0.0


BRACKETED = re.compile(r"\[\s*(-?\d+(?:\.\d+)?)\s*\]")


def count_answer_reward(response: str, answer: str) -> float:
    """The counting reward (the user's documents' `clevr_count_70k`): the answer is the last
    number in square brackets ("there are [3] objects", as CLEVR-Count-70K's prompts ask), else
    the response's final answer as `exact_answer_reward` reads it; 1.0 when it equals `answer`
    numerically."""
    bracketed = BRACKETED.findall(response)
    return exact_answer_reward(bracketed[-1] if bracketed else response, answer)


def digit_match_reward(response: str, answer: str, partial_weight: float = 0.5) -> float:
    """Partial credit for integer answers: 1.0 when exact, else `partial_weight` times the share
    of digit places (aligned from the units) that match, over the longer of the two numbers.

    "167" vs reference "167" -> 1.0; "165" -> 0.5 * 2/3; "67" -> 0.5 * 2/3; no number -> 0.0.
    A denser signal than exact match for small models that get most digits right; the optimum is
    still the exact answer. Non-integer references fall back to exact_answer_reward.
    """
    if exact_answer_reward(response, answer):
        return 1.0
    predicted = extract_final_answer(response)
    reference = str(answer).strip().replace(",", "")
    if predicted is None or not reference.lstrip("-").isdigit() or not predicted.lstrip("-").isdigit():
        return 0.0
    if predicted.startswith("-") != reference.startswith("-"):
        return 0.0
    a, b = predicted.lstrip("-")[::-1], reference.lstrip("-")[::-1]
    same = sum(x == y for x, y in zip(a, b))
    return partial_weight * same / max(len(a), len(b))


# The checks a config names (reward: exact | digits | clevr_count_70k)
CHEAP_CHECKS = {"exact": exact_answer_reward, "digits": digit_match_reward,
                "clevr_count_70k": count_answer_reward}
