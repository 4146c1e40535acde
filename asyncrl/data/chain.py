"""Chain sums with a worked solution: the embedded task whose generation lengths have a long tail.

A problem adds k one- or two-digit numbers ("7+35+12="); its worked solution writes one running
total per line ("7+35=42", "42+12=54") before the final answer ("#### 54"), so a reply is about
`9 * (k - 1) + 8` characters (tokens, for the embedded model, one token per ASCII character). k is 2 plus a
geometric number of extra terms (each one with probability `tail`, up to `max_terms`): most
replies are short and a few are many times longer, the shape that leaves a synchronous loop
waiting on its slowest sample. Rows carry the solution for the SFT warm start (`solution`) and
the number of terms (`terms`); the reward is the final answer (`reward: exact` reads `####`).

Problems come from a seeded RNG and are deduplicated by expression; eval problems are drawn first
and never appear in train, as for the arithmetic task.
"""

from __future__ import annotations

import random
from typing import Literal

import pydantic

from asyncrl.config import ConfigError
from asyncrl.data.kind import DatasetKind
from asyncrl.data.split import Row, fill_prompt, make_row, require_placeholder, text_id


class ChainTaskConfig(DatasetKind):
    # the dataset (DATASETS: arithmetic | arithmetic_submit | chain | counting | gsm8k | jsonl | parquet | hf)
    kind: Literal["chain"] = "chain"
    digits: int = pydantic.Field(2, ge=1, le=4, description="max digits per operand")
    min_terms: int = pydantic.Field(2, ge=2)  # numbers in the shortest problems
    max_terms: int = pydantic.Field(12, ge=2)  # and in the longest
    # the chance of each further term: P(k terms) falls geometrically from min_terms
    tail: float = pydantic.Field(0.6, ge=0.0, lt=1.0)
    num_train: int = pydantic.Field(9000, ge=0)  # training problems
    num_eval: int = pydantic.Field(500, ge=0)  # held-out problems, never trained on
    seed: int = 0  # the problems drawn (train and eval)
    prompt_template: str = "{expr}="  # the user message; {expr} is the expression

    @pydantic.field_validator("prompt_template")
    @classmethod
    def _template_shows_expr(cls, template: str) -> str:
        return require_placeholder(template, "{expr}")

    @pydantic.model_validator(mode="after")
    def _terms_in_order(self) -> ChainTaskConfig:
        if self.max_terms < self.min_terms:
            raise ValueError(f"max_terms={self.max_terms} is out of range; allowed "
                             f">= min_terms={self.min_terms}")
        return self

    def build(self) -> ChainTask:
        return ChainTask(self)


def solution(operands: list[int]) -> tuple[str, int]:
    """The worked lines ("a+b=s", "s+c=t", ...) and the total."""
    total, lines = operands[0], []
    for x in operands[1:]:
        lines.append(f"{total}+{x}={total + x}")
        total += x
    return "\n".join(lines), total


class ChainTask:
    """Train and eval rows for one ChainTaskConfig, generated once at construction."""

    def __init__(self, cfg: ChainTaskConfig) -> None:
        self.cfg = cfg
        rows = self._rows(cfg.num_eval + cfg.num_train)
        self._eval, self._train = rows[:cfg.num_eval], rows[cfg.num_eval:]

    def train_rows(self) -> list[Row]:
        return list(self._train)

    def eval_rows(self) -> list[Row]:
        return list(self._eval)

    def _terms(self, rng: random.Random) -> int:
        k = self.cfg.min_terms
        while k < self.cfg.max_terms and rng.random() < self.cfg.tail:
            k += 1
        return k

    def _rows(self, needed: int) -> list[Row]:
        rng, top = random.Random(self.cfg.seed), 10 ** self.cfg.digits
        seen: set[str] = set()
        out: list[Row] = []
        for _ in range(100 * needed + 100_000):
            if len(out) == needed:
                return out
            operands = [rng.randrange(top) for _ in range(self._terms(rng))]
            expr = "+".join(map(str, operands))
            if expr in seen:
                continue
            seen.add(expr)
            worked, total = solution(operands)
            out.append(make_row(text_id(expr, "chain"), expr, str(total),
                                fill_prompt(self.cfg.prompt_template, "{expr}", expr),
                                solution=worked, terms=len(operands)))
        if len(out) == needed:
            return out
        raise ConfigError(f"chain task: digits={self.cfg.digits}, terms {self.cfg.min_terms}.."
                          f"{self.cfg.max_terms} gave only {len(out)} distinct problems, fewer "
                          f"than num_train + num_eval = {needed}; raise digits or max_terms")
