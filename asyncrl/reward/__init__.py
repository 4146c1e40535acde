"""Rewards: scoring a completion, and turning per-turn rewards into returns. No model or tokenizer.

- `exact`, `math_verify`, `code`: checks of (response text, reference) -> float.
- `call`: `RewardFn(completion_text, row)`, sync or async, as workflows and eval call it
  (`call_reward`: sync ones off the event loop unless marked `inline`; `call_rewards` for a
  group), and `answer_reward` adapting a (response, answer) check to it.
- `config`, `registry`: rewards by name or typed config for configs and the CLI (`exact`,
  `digits`, `math`, `code`, a dotted path, `trl:<path>`, `{kind: judge, ...}`), each opened as a
  context manager (`open_reward`).
- `judge`: a model-judged reward and its config; `trl_adapter`: TRL GRPOTrainer reward functions.
- `returns`: discounted returns over turns, shared by multi-turn workflows and proxy sessions.
- `pool`, `pooled`, `sandbox`, `sandbox_launcher`: running rewards in worker processes / a sandbox.

Importing any of `call`, `registry`, `returns` or this package stays light (no torch).
"""

from asyncrl.reward.exact import exact_answer_reward, extract_final_answer

__all__ = ["exact_answer_reward", "extract_final_answer"]
