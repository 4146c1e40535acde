"""Measure a calculator-agent warm start on held-out problems with the in-process engine.

    OMP_NUM_THREADS=1 python -m examples.tool_agent.measure_warm_start MODEL_DIR \
        [--eval examples/tool_agent/data/eval.jsonl] [--samples 4] [--limit 200]

For greedy decoding and for sampling at temperature 1 (`--samples` per problem) it reports:
  tool_call_ok     first turn is exactly one well-formed calc call whose expression evaluates to
                   the answer (what RL through the proxy rewards getting right);
  tool_call_wrong  a well-formed call with a wrong expression;
  malformed        the first turn tries a call ("<tool_call>") that does not parse;
  direct           the first turn answers without the tool (direct_correct: and is right);
  copy_ok          among well-formed calls, the final answer equals the tool's result;
  end_to_end       the episode's final answer is right (tool result fed back via calc()).
The second turn sees the assistant message as the proxy would return it (`tool_calls` with
compact JSON arguments), rendered by the model's chat template, like an OpenAI agent's next call.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from asyncrl.api import GenerationConfig, ModelRequest
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.models.chat import encode_chat_prompt
from asyncrl.models.loading import load_tokenizer
from examples.tool_agent.task import TOOLS, arguments_json, calc, check_answer, parse_call

MAX_NEW_TOKENS = 96


def generate(engine: LLMEngine, tok: Any, convs: list[list[dict]], gconfig: GenerationConfig,
             seed: int) -> list[str]:
    reqs = [ModelRequest(encode_chat_prompt(tok, c, tools=TOOLS), gconfig.replace(seed=seed + i))
            for i, c in enumerate(convs)]
    return [tok.decode(r.output_tokens, skip_special_tokens=True)
            for r in engine.generate(reqs)]


def after_call(conv: list[dict], expr: str) -> list[dict]:
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calc", "arguments": arguments_json(expr)}}
    return [*conv, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": calc(expr)}]


def classify(text: str, answer: str) -> str:
    expr = parse_call(text)
    if expr is not None:
        return "tool_call_ok" if calc(expr) == answer else "tool_call_wrong"
    if "<tool_call>" in text:
        return "malformed"
    return "direct_correct" if check_answer(text, answer) else "direct_wrong"


def run_mode(engine: LLMEngine, tok: Any, rows: list[dict], gconfig: GenerationConfig,
             samples: int, seed: int) -> dict[str, float]:
    rows = [r for r in rows for _ in range(samples)]
    convs = [[{"role": "user", "content": r["question"]}] for r in rows]
    first = generate(engine, tok, convs, gconfig, seed)
    kinds = [classify(t, r["answer"]) for t, r in zip(first, rows)]
    called = [i for i, t in enumerate(first) if parse_call(t) is not None]
    seconds = [after_call(convs[i], parse_call(first[i])) for i in called]
    finals = generate(engine, tok, seconds, gconfig, seed + len(rows))
    copied = sum(check_answer(f, s[-1]["content"]) for f, s in zip(finals, seconds))
    correct = sum(check_answer(f, rows[i]["answer"]) for f, i in zip(finals, called))
    correct += kinds.count("direct_correct")
    counts = Counter(kinds)
    n = len(rows)
    out = {k: counts[k] / n for k in ("tool_call_ok", "tool_call_wrong", "malformed",
                                      "direct_wrong", "direct_correct")}
    out["copy_ok"] = copied / max(1, len(called))
    out["end_to_end"] = correct / n
    out["episodes"] = n
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--eval", default="examples/tool_agent/data/eval.jsonl")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--samples", type=int, default=4, help="samples per problem at T=1")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lines = Path(args.eval).read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()][: args.limit]
    tok = load_tokenizer(args.model_dir)
    engine = LLMEngine(EngineConfig(model_path=args.model_dir, num_threads=args.threads,
                                    seed=args.seed))
    results = {}
    for name, gconfig, samples in (
            ("greedy", GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, greedy=True), 1),
            ("sampled_t1", GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0),
             args.samples)):
        t0 = time.perf_counter()
        results[name] = run_mode(engine, tok, rows, gconfig, samples, args.seed)
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps({k: round(v, 3) for k, v in results[name].items()}))
    print(json.dumps({"model_dir": args.model_dir, "problems": len(rows), **results}))


if __name__ == "__main__":
    main()
