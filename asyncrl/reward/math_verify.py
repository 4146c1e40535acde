"""Math-answer reward: 1.0 when the response's final answer equals the reference mathematically.

Both sides go through the `math_verify` library (HuggingFace): the reference and the prediction are
parsed into sympy objects and compared symbolically and numerically, so "\\boxed{1/2}", "0.5" and
"$\\frac{1}{2}$" all match. Which part of the response counts as the answer, in order:
1. the text after the last "####" (the GSM8K convention, also used by `reward.exact`);
2. a \\boxed{...} expression (highest priority in math_verify's LaTeX extraction);
3. math_verify's other extractions ("final answer is ...", then the last number / expression).
A GSM8K reference may be a whole solution: only the text after its last "####" is used.

Never call this in-process from the trainer: math_verify bounds sympy work with SIGALRM, which
exists only in a process's main thread (elsewhere math_verify raises ValueError), and some inputs
("(10^8)!", huge powers) spend a long time inside single C calls that the alarm cannot interrupt.
Run it through `asyncrl.reward.pool.RewardPool`, whose workers call rewards in their main thread
and are killed when they exceed the pool's timeout.
"""

from __future__ import annotations

import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from asyncrl.reward.exact import MARKER

# math_verify's own per-step alarm; the pool's timeout is the outer bound.
DEFAULT_TIMEOUT_SECONDS = 5

PREDICTION_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
GOLD_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())


def math_answer_reward(
    response: str, answer: str, timeout_seconds: int = DEFAULT_TIMEOUT_SECONDS
) -> float:
    """1.0 if `response`'s final answer equals `answer` per math_verify, else 0.0."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "math_answer_reward must run in a process's main thread (math_verify times out with "
            "SIGALRM); score it through asyncrl.reward.pool.RewardPool"
        )
    if timeout_seconds < 1:
        raise ValueError(
            f"timeout_seconds={timeout_seconds} must be >= 1 (SIGALRM counts whole seconds)"
        )
    gold = parse_reference(str(answer), timeout_seconds)
    if not gold:
        # An unparseable reference is a dataset problem, not a wrong answer: say so loudly.
        raise ValueError(f"answer={answer!r}: math_verify cannot parse the reference answer")
    predicted = parse_prediction(response, timeout_seconds)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout_seconds) else 0.0


def parse_reference(answer: str, timeout_seconds: int = DEFAULT_TIMEOUT_SECONDS) -> list:
    text = answer.rpartition(MARKER)[2].strip() if MARKER in answer else answer.strip()
    # Bare LaTeX ("\frac34") is only recognised between $ signs; plain numbers parse either way.
    candidates = [text] if "$" in text or "\\boxed" in text else [f"${text}$", text]
    for candidate in candidates:
        parsed = parse(candidate, GOLD_CONFIG, parsing_timeout=timeout_seconds)
        if parsed:
            return parsed
    return []


def parse_prediction(response: str, timeout_seconds: int = DEFAULT_TIMEOUT_SECONDS) -> list:
    if MARKER in response:
        # math_verify alone would take the last number anywhere, and misses "####72" entirely.
        tail = response.rpartition(MARKER)[2]
        parsed = parse(tail, PREDICTION_CONFIG, parsing_timeout=timeout_seconds)
        if parsed:
            return parsed
    return parse(response, PREDICTION_CONFIG, parsing_timeout=timeout_seconds)
