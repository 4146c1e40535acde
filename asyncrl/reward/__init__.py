"""Reward functions: pure functions of (response text, reference), no model or tokenizer."""

from asyncrl.reward.exact import exact_answer_reward, extract_final_answer

__all__ = ["exact_answer_reward", "extract_final_answer"]
