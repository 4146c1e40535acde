"""Reward functions written outside the package, named by dotted path in the reward tests
(tests/ is on sys.path, so `reward_plugins:slow_reward` resolves, in RewardPool workers too)."""

import threading
import time

BATCHES: list[int] = []  # sizes of the batches trl_style_reward was called with


def slow_reward(completion: str, row: dict) -> float:
    """A slow verifier (an HTTP call, an LLM judge): blocks its thread for half a second."""
    time.sleep(0.5)
    return 1.0 if completion == str(row["answer"]) else 0.0


def raising_reward(completion: str, row: dict) -> float:
    raise ValueError(f"cannot score {completion!r}")


def main_thread_reward(completion: str, row: dict) -> float:
    """1.0 only in a process's main thread (what math_verify's SIGALRM needs)."""
    return 1.0 if threading.current_thread() is threading.main_thread() else 0.0


def trl_style_reward(prompts, completions, completion_ids=None, **kwargs):
    """Written for TRL's GRPOTrainer: conversational completions, dataset columns as lists."""
    BATCHES.append(len(completions))
    out = []
    ids_of = completion_ids or [[] for _ in completions]  # None where asyncrl has no ids (eval)
    for prompt, completion, ids, solution in zip(prompts, completions, ids_of,
                                                  kwargs["solution"]):
        assert prompt[-1]["role"] == "user" and completion[0]["role"] == "assistant"
        text = completion[0]["content"]
        out.append(None if solution is None else float(text.strip() == solution) + 0.01 * len(ids))
    return out


def length_penalty(completions, **kwargs):
    return [-0.1 * len(c[0]["content"]) for c in completions]
