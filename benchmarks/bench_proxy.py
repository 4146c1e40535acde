"""Cost of the agent proxy: the same two-turn episodes run (a) as a hand-written workflow that
calls the engine directly with token ids (the baseline every peer's built-in workflows use) and
(b) as an ordinary `openai`-SDK agent through the proxy (HTTP, chat template, prompt reuse,
recording, export). Same tiny model, same in-process engine, same prompts, every reply exactly
`--tokens` tokens (min = max), the same concurrency; (a) and (b) alternate `--repeats` times and
the best of each is reported, so machine noise hits both alike.

    python benchmarks/bench_proxy.py                       # 128 episodes, 32 at a time
    python benchmarks/bench_proxy.py --episodes 256 --concurrency 64 --tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import torch

from asyncrl.api import GenerationConfig, ModelRequest
from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.models.chat import encode_chat_prompt, render_chat
from asyncrl.models.loading import load_tokenizer
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.proxy.config import AgentConfig, ProxyConfig
from asyncrl.proxy.server import ProxyServer
from asyncrl.proxy.workflow import AgentWorkflow

FEEDBACK = "Check it again."


class TwoTurnAgent:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    async def run(self, data, **kw):
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"],
                             http_client=kw["http_client"], max_retries=0)
        messages = list(data["messages"])
        for _ in range(2):
            r = await client.chat.completions.create(
                model="default", messages=messages, max_tokens=self.tokens,
                extra_body={"min_tokens": self.tokens})
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": FEEDBACK}]
        return 1.0


async def direct_episode(engine, tokenizer, row, g: GenerationConfig) -> int:
    ids = encode_chat_prompt(tokenizer, row["messages"])
    feedback = tokenizer.encode("\n" + render_chat(tokenizer, [{"role": "user",
                                                                 "content": FEEDBACK}]),
                                add_special_tokens=False)
    for _ in range(2):
        out = await engine.agenerate(ModelRequest(input_ids=list(ids), gconfig=g))
        ids += out.output_tokens + feedback
    return len(ids)


async def bounded(coros, concurrency: int) -> list:
    gate = asyncio.Semaphore(concurrency)

    async def one(c):
        async with gate:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    path = build_tiny_model(TinyModelConfig(), tempfile.mkdtemp() + "/tiny")
    tokenizer = load_tokenizer(path)
    engine = AsyncLLMEngine(EngineConfig(model_path=str(path), max_num_seqs=args.concurrency,
                                         num_threads=args.threads))
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"{i % 90 + 10}+{i % 7}="}]}
            for i in range(args.episodes)]
    g = GenerationConfig(max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                         stop_token_ids=[tokenizer.eos_token_id])
    proxy = ProxyServer(engine, tokenizer, ProxyConfig(max_tokens_cap=args.tokens),
                        context_length=1024)
    workflow = AgentWorkflow(TwoTurnAgent(args.tokens), proxy, AgentConfig())
    await workflow.ensure_started()
    best = {"direct": float("inf"), "proxy": float("inf")}
    reused = 0
    for rep in range(args.repeats + 1):  # the first round warms both paths up
        t0 = time.perf_counter()
        await bounded([direct_episode(engine, tokenizer, r, g) for r in rows], args.concurrency)
        t1 = time.perf_counter()
        trajs = await bounded([workflow.arun_episode(engine, r) for r in rows], args.concurrency)
        t2 = time.perf_counter()
        assert all(t is not None and len(t.samples) == 2 for t in trajs), "an episode failed"
        if rep:
            best["direct"] = min(best["direct"], t1 - t0)
            best["proxy"] = min(best["proxy"], t2 - t1)
        reused = proxy.routes.stats["reused_prompts"]
    await workflow.aclose()
    engine.shutdown()
    n_req = 2 * args.episodes
    print(f"{args.episodes} two-turn episodes, {args.tokens} tokens per reply, concurrency "
          f"{args.concurrency}, best of {args.repeats}, torch threads {args.threads}")
    print(f"{'path':<34}{'seconds':>9}{'episodes/s':>12}{'ratio':>8}")
    for name, label in (("direct", "direct engine calls (baseline)"),
                        ("proxy", "openai SDK agent through proxy")):
        print(f"{label:<34}{best[name]:>9.2f}{args.episodes / best[name]:>12.1f}"
              f"{best['direct'] / best[name]:>8.2f}x")
    extra_ms = (best["proxy"] - best["direct"]) / n_req * 1e3
    print(f"proxy overhead: {extra_ms:+.2f} ms per request (wall, at this concurrency); "
          f"second turns that reused sampled ids: {reused} of {args.episodes * (args.repeats + 1)}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    asyncio.run(main(p.parse_args()))
