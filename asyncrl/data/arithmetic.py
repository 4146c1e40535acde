"""Synthetic arithmetic with exact integer answers: the embedded verifiable task.

Difficulty is set by operand digits, operand count and the operator set; `*` binds tighter than
`+`/`-` as usual, and values are computed from the generated integers (nothing is ever eval'd).
Prompts stay short ("12+34=") because the default policy is a ~6M-parameter model with one token per ASCII character.

Problems come from a seeded RNG and are deduplicated by expression. Eval problems are drawn first,
so the held-out set does not move when num_train changes, and no eval problem appears in train.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from typing import Literal, NamedTuple

import pydantic

from asyncrl.config import ConfigError
from asyncrl.data.kind import DatasetKind
from asyncrl.data.split import Row, fill_prompt, make_row, require_placeholder, text_id

Operator = Literal["+", "-", "*"]
SIGN = {"+": 1, "-": -1}

# Problem spaces up to this many expressions are enumerated, which gives the exact count of valid
# problems (negatives excluded) and never stalls near exhaustion; larger ones are sampled.
ENUMERATE_LIMIT = 200_000


class ArithmeticTaskConfig(DatasetKind):
    # the synthetic task: arithmetic expressions with a numeric answer
    # the dataset (DATASETS: arithmetic | arithmetic_submit | chain | counting | gsm8k | jsonl | parquet | hf)
    kind: Literal["arithmetic"] = "arithmetic"
    digits: int = pydantic.Field(2, ge=1, le=6, description="max digits per operand")
    num_operands: int = pydantic.Field(2, ge=2, le=4)  # numbers per expression
    # drawn uniformly per position
    operators: list[Operator] = pydantic.Field(default_factory=lambda: ["+"], min_length=1)
    allow_negative: bool = pydantic.Field(
        False, description="False: redraw problems whose running result goes below zero")
    # 9000, not more: the defaults must fit the 10,000 distinct 2-digit sums, eval included.
    num_train: int = pydantic.Field(9000, ge=0)
    num_eval: int = pydantic.Field(500, ge=0)  # held-out problems, never trained on
    seed: int = 0  # the problems drawn (train and eval)
    prompt_template: str = "{expr}="  # the user message; {expr} is the expression

    @pydantic.field_validator("operators")
    @classmethod
    def _distinct_operators(cls, ops: list[str]) -> list[str]:
        if len(set(ops)) != len(ops):
            raise ValueError(f"operators={ops!r}: list each operator at most once")
        return ops

    @pydantic.field_validator("prompt_template")
    @classmethod
    def _template_shows_expr(cls, template: str) -> str:
        return require_placeholder(template, "{expr}")

    def build(self) -> ArithmeticTask:
        return ArithmeticTask(self)


class Problem(NamedTuple):
    expr: str
    value: int


def evaluate(operands: Sequence[int], ops: Sequence[str]) -> tuple[int, int]:
    """(value, lowest running total) of `operands` joined by `ops`, with `*` before `+`/`-`.

    The running total is taken over the additive terms left to right; it is what
    allow_negative=False keeps at or above zero (so 3-5*2+20 is rejected although it ends at 13).
    """
    terms = [operands[0]]
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(SIGN[op] * x)
    total, lowest = 0, 0
    for t in terms:
        total += t
        lowest = min(lowest, total)
    return total, lowest


def render(operands: Sequence[int], ops: Sequence[str]) -> str:
    parts = [str(operands[0])]
    for op, x in zip(ops, operands[1:]):
        parts += [op, str(x)]
    return "".join(parts)


class ArithmeticTask:
    """Train and eval rows for one ArithmeticTaskConfig, generated once at construction."""

    def __init__(self, cfg: ArithmeticTaskConfig):
        self.cfg = cfg
        problems = self._distinct_problems(cfg.num_eval + cfg.num_train)
        self._eval = [self._row(p) for p in problems[: cfg.num_eval]]
        self._train = [self._row(p) for p in problems[cfg.num_eval:]]

    def train_rows(self) -> list[Row]:
        return list(self._train)

    def eval_rows(self) -> list[Row]:
        return list(self._eval)

    def _row(self, p: Problem) -> Row:
        prompt = fill_prompt(self.cfg.prompt_template, "{expr}", p.expr)
        return make_row(text_id(p.expr, "arith"), p.expr, str(p.value), prompt)

    def upper_bound(self) -> int:
        """Number of expressions before the no-negative rule: operand choices x operator choices."""
        n = self.cfg.num_operands
        return (10 ** self.cfg.digits) ** n * len(self.cfg.operators) ** (n - 1)

    def _valid(self, operands: Sequence[int], ops: Sequence[str]) -> Problem | None:
        value, lowest = evaluate(operands, ops)
        if lowest < 0 and not self.cfg.allow_negative:
            return None
        return Problem(render(operands, ops), value)

    def _enumerate(self) -> Iterator[Problem]:
        cfg = self.cfg
        numbers = range(10 ** cfg.digits)
        for ops in itertools.product(cfg.operators, repeat=cfg.num_operands - 1):
            for operands in itertools.product(numbers, repeat=cfg.num_operands):
                if (p := self._valid(operands, ops)) is not None:
                    yield p

    def _too_small(self, found: int, needed: int, how: str) -> ConfigError:
        c = self.cfg
        return ConfigError(
            f"arithmetic task: digits={c.digits}, num_operands={c.num_operands}, "
            f"operators={c.operators}, allow_negative={c.allow_negative} {how} {found} distinct "
            f"problems, fewer than num_train + num_eval = {c.num_train} + {c.num_eval} = {needed}; "
            "raise digits or num_operands, add operators, or lower num_train/num_eval")

    def _distinct_problems(self, needed: int) -> list[Problem]:
        rng = random.Random(self.cfg.seed)
        if self.upper_bound() <= ENUMERATE_LIMIT:
            problems = list(self._enumerate())
            if len(problems) < needed:
                raise self._too_small(len(problems), needed, "give only")
            rng.shuffle(problems)
            return problems[:needed]
        return self._sample(rng, needed)

    def _sample(self, rng: random.Random, needed: int) -> list[Problem]:
        cfg = self.cfg
        top = 10 ** cfg.digits
        seen: set[str] = set()
        out: list[Problem] = []
        # Generous: even a 1-in-20 acceptance rate with many repeats finishes well inside this.
        max_draws = 100 * needed + 100_000
        for _ in range(max_draws):
            if len(out) == needed:
                return out
            operands = [rng.randrange(top) for _ in range(cfg.num_operands)]
            ops = [rng.choice(cfg.operators) for _ in range(cfg.num_operands - 1)]
            p = self._valid(operands, ops)
            if p is not None and p.expr not in seen:
                seen.add(p.expr)
                out.append(p)
        if len(out) == needed:
            return out
        raise self._too_small(len(out), needed, f"yielded (in {max_draws} random draws) only")
