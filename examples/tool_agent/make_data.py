"""Write the calculator-agent data: an imperfect SFT mixture plus RL prompt files.

    python -m examples.tool_agent.make_data [--out examples/tool_agent/data] [--seed 0]

All 8,100 problems a*b (a, b in 10..99) are shuffled once (seeded); 200 are held out:
  eval.jsonl       the 200 held-out prompts {id, question, answer}, for RL evaluation and the
                   warm-start measurement;
  sft_eval.jsonl   the same 200 problems as clean tool-use conversations (SFT's eval rows: its
                   greedy score is "first turn == the right tool call");
  sft.jsonl        one conversation row per other problem (7,900), a deliberately imperfect
                   mixture so that RL has room to improve: ~55% correct tool use, ~25% a direct
                   (wrong) guess without the tool, ~20% a malformed tool call after which the
                   conversation ends. Every problem, not a subset: the model must learn to copy
                   the operands, and with few distinct rows it memorises them instead;
  train.jsonl      the same 7,900 problems as RL prompts.
The prompt rows' `question` is the user message itself (FileDatasetConfig's default
prompt_template "{question}" turns it into `messages`); agents pass `tools=TOOLS`.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

from examples.tool_agent.task import (TOOLS, all_problems, arguments_json, calc, tool_call_text,
                                      user_message)

NUM_EVAL = 200
MIXTURE = (("tool", 0.55), ("direct", 0.25), ("malformed", 0.20))


def tool_use(a: int, b: int) -> list[dict[str, Any]]:
    expr = f"{a}*{b}"
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calc", "arguments": arguments_json(expr)}}
    result = calc(expr)
    return [{"role": "user", "content": user_message(a, b)},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": result}]


def direct_guess(a: int, b: int, rng: random.Random) -> list[dict[str, Any]]:
    # A nearby wrong number (a*b >= 100, so it stays positive): plausible-looking, never right,
    # a habit RL can unlearn.
    guess = a * b + rng.choice((-1, 1)) * rng.randint(1, 50)
    return [{"role": "user", "content": user_message(a, b)},
            {"role": "assistant", "content": str(guess)}]


def malformed_call(a: int, b: int, rng: random.Random) -> list[dict[str, Any]]:
    text = tool_call_text(f"{a}*{b}")
    if rng.random() < 0.5:
        text = text.replace("}}</tool_call>", "}</tool_call>")  # missing closing brace
    else:
        text = text.removesuffix("</tool_call>")  # missing closing tag
    return [{"role": "user", "content": user_message(a, b)},
            {"role": "assistant", "content": text}]


def pick_kind(rng: random.Random) -> str:
    x, total = rng.random(), 0.0
    for kind, share in MIXTURE:
        total += share
        if x < total:
            return kind
    return MIXTURE[-1][0]


def conversation(kind: str, a: int, b: int, rng: random.Random) -> list[dict[str, Any]]:
    if kind == "tool":
        return tool_use(a, b)
    return direct_guess(a, b, rng) if kind == "direct" else malformed_call(a, b, rng)


def prompt_row(a: int, b: int) -> dict[str, Any]:
    return {"id": f"mul-{a}x{b}", "question": user_message(a, b), "answer": str(a * b)}


def sft_row(kind: str, a: int, b: int, rng: random.Random) -> dict[str, Any]:
    return {**prompt_row(a, b), "kind": kind, "tools": TOOLS,
            "conversation": conversation(kind, a, b, rng)}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def make_files(out: Path, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    problems = all_problems()
    rng.shuffle(problems)
    held_out, train = problems[:NUM_EVAL], problems[NUM_EVAL:]
    out.mkdir(parents=True, exist_ok=True)
    sft_rows = [sft_row(pick_kind(rng), a, b, rng) for a, b in train]
    write_jsonl(out / "sft.jsonl", sft_rows)
    write_jsonl(out / "sft_eval.jsonl", [sft_row("tool", a, b, rng) for a, b in held_out])
    write_jsonl(out / "train.jsonl", [prompt_row(a, b) for a, b in train])
    write_jsonl(out / "eval.jsonl", [prompt_row(a, b) for a, b in held_out])
    return dict(Counter(r["kind"] for r in sft_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="examples/tool_agent/data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kinds = make_files(Path(args.out), args.seed)
    print(f"wrote {args.out}: sft mixture {kinds}")


if __name__ == "__main__":
    main()
