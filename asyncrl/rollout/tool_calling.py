"""Episodes that call tools over HTTP between turns: generate, call, read the result, answer.

The prompt is rendered with the tool definitions (`schemas`); each reply is read with the model's
tool parser (`model.tool_parser`). A reply with well-formed calls sends each call to the tool
service (`ToolClient`: a timeout, a 5xx, a refused connection or a call the tool rejects comes back
as an "error: ..." result the policy reads, and is counted), then the tool messages are rendered
with the chat template right after the reply's own sampled ids and the model answers. One
training sequence holds the whole episode: generated tokens are trained on (loss_mask 1, their
versions), the tool results are not (mask 0). A row's `tool_context` (the episode's state held
by the harness, e.g. the answer a remote grader grades against) goes with each of its calls as the
`context` argument, with `reply`: the text of the reply that made the call. The reward reads the final reply; the row it gets
also holds `tool_results` (the texts the tools returned, in order) for rewards that credit a right
call. An episode whose `max_tool_calls` rounds are used up ends with its last reply.

`metrics()` (api.ReportsMetrics) reports, per training step, the calls made, the failures by kind,
the observed tool latency (median, p99) and the share of replies that tried a call and got its
format wrong.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from typing import Any

from asyncrl.api import (EvalReport, GenerationConfig, InferenceEngine, ModelRequest, Sample,
                         Trajectory)
from asyncrl.api.episode import EpisodeRejected
from asyncrl.api.trajectory import PROMPT_VERSION
from asyncrl.models.chat import encode_chat_prompt, stop_at_eos, text_after_reply
from asyncrl.models import routes
from asyncrl.models.chat_options import ChatOptions, decode_keeping
from asyncrl.reward.call import RewardFn, call_reward
from asyncrl.rollout.answer_eval import EvalConfig
from asyncrl.rollout.tool_service import ToolClient, ToolError, ToolReply


class ToolStats:
    """Tool calls since the last `take()`: counts by outcome and the latencies (thread-safe: the
    executor's loop records, the training loop takes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.calls = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.seconds: list[float] = []
        self.replies = self.malformed = 0

    def call(self, reply: ToolReply) -> None:
        with self._lock:
            self.calls += 1
            self.seconds.append(reply.seconds)
            if reply.error is not None:
                self.errors[reply.error.value] += 1

    def episode(self, replies: int, malformed: int) -> None:
        with self._lock:
            self.replies += replies
            self.malformed += malformed

    def take(self) -> dict[str, float]:
        with self._lock:
            out = {"tools/calls": float(self.calls),
                   "tools/error_frac": sum(self.errors.values()) / self.calls if self.calls
                   else 0.0,
                   **{f"tools/errors_{kind.value}": float(self.errors[kind.value])
                      for kind in ToolError}}
            if self.seconds:
                ordered = sorted(self.seconds)
                out["tools/latency_p50_s"] = ordered[len(ordered) // 2]
                out["tools/latency_p99_s"] = ordered[min(len(ordered) - 1,
                                                         int(0.99 * len(ordered)))]
            if self.replies:
                out["tools/malformed_call_frac"] = self.malformed / self.replies
            self._reset()
        return out


class ToolCallingWorkflow:
    def __init__(self, reward_fn: RewardFn, gconfig: GenerationConfig, tokenizer: Any,
                 client: ToolClient, schemas: list[dict[str, Any]] | None, max_tool_calls: int = 1,
                 eval_cfg: EvalConfig | None = None, chat: ChatOptions | None = None,
                 context_length: int | None = None, reward_sees_reasoning: bool = False,
                 on_close: Any = None, eval_client: ToolClient | None = None) -> None:
        """`client`: the tool service's; `schemas`: the OpenAI tool definitions the prompt shows
        (None: no tool list, for a policy trained to call its tools without one);
        `on_close`: called by `aclose` (the job's service process stops there); `eval_client`:
        the one evaluations call through (default `client`)."""
        self.reward_fn, self.tokenizer, self.client = reward_fn, tokenizer, client
        self.eval_client = eval_client
        self.schemas, self.max_tool_calls = schemas, max_tool_calls
        self.chat = chat or ChatOptions()
        self.gconfig = stop_at_eos(gconfig.replace(n_samples=1), tokenizer)
        self.eval_cfg = eval_cfg or EvalConfig()
        self.context_length, self.reward_sees_reasoning = context_length, reward_sees_reasoning
        self.stats = ToolStats()
        self.markers = self.chat.marker_ids(tokenizer)
        self._on_close = on_close

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> EvalReport:
        """Greedy episodes on the held-out rows, tools called as in training: the share whose
        reward is full (>= 1: the answer is right) is `eval/greedy_accuracy`; also the mean
        reward, the share of episodes that called a tool and the tool failures they met."""
        t0 = time.perf_counter()
        greedy = ToolCallingWorkflow(
            self.reward_fn, self.gconfig.replace(greedy=True, max_new_tokens=self.eval_cfg
                                                 .max_new_tokens or self.gconfig.max_new_tokens),
            self.tokenizer, self.eval_client or self.client, self.schemas, self.max_tool_calls,
            self.eval_cfg,
            self.chat, self.context_length, self.reward_sees_reasoning)
        gate = asyncio.Semaphore(self.eval_cfg.concurrency)

        async def one(row: dict[str, Any]) -> Sample:
            async with gate:
                return (await greedy.arun_episode(engine, row)).samples[0]

        samples = await asyncio.gather(*(one(r) for r in rows))
        n = max(len(samples), 1)
        stats = greedy.stats.take()
        accuracy = sum(s.reward >= 1.0 for s in samples) / n
        metrics = {"eval/greedy_accuracy": accuracy,
                   "eval/reward": sum(s.reward for s in samples) / n,
                   "eval/tool_call_frac": sum(s.metadata["tool_calls"] > 0 for s in samples) / n,
                   "eval/tool_error_frac": stats["tools/error_frac"],
                   "eval/num_problems": float(len(samples)),
                   "eval/seconds": time.perf_counter() - t0}
        answers = {str(r.get("id", i)): (s.metadata["completion_text"], s.reward)
                   for i, (r, s) in enumerate(zip(rows, samples))}
        return EvalReport(accuracy, "greedy accuracy", metrics,
                          f", called a tool {metrics['eval/tool_call_frac']:.0%}", answers)

    async def _call(self, call: dict[str, Any], context: Any) -> ToolReply:
        fn = call["function"]
        try:
            arguments = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) \
                else fn["arguments"]
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            reply = ToolReply(f"error: the arguments of {fn['name']} must be a JSON object",
                              ToolError.BAD_CALL, 0.0)
        else:
            if context is not None:  # the episode's state, from the harness (not the policy)
                arguments = {**arguments, "context": context}
            reply = await self.client.call(fn["name"], arguments)
        self.stats.call(reply)
        return reply

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Trajectory:
        kwargs = self.chat.template_kwargs()
        messages = list(data["messages"])
        ids = encode_chat_prompt(self.tokenizer, messages, self.schemas, kwargs)
        mask, logps, vers = [0] * len(ids), [0.0] * len(ids), [PROMPT_VERSION] * len(ids)
        results: list[str] = []
        malformed = replies = 0
        for round_ in range(self.max_tool_calls + 1):
            resp = await engine.agenerate(ModelRequest(input_ids=list(ids), gconfig=self.gconfig))
            ids += resp.output_tokens
            mask += [1] * resp.output_len
            logps += resp.output_logprobs
            vers += resp.output_versions
            text = decode_keeping(self.tokenizer, resp.output_tokens, self.markers)
            reply = self.chat.read_reply(text, parse_tools=True, template_kwargs=kwargs)
            replies += 1
            malformed += reply.malformed_tool_call
            if not reply.tool_calls or round_ == self.max_tool_calls:
                break
            context = data.get("tool_context")
            if context is not None:  # with the reply that made the calls (a `submit` grades it)
                context = {**context, "reply": reply.content or ""}
            tool_replies = await asyncio.gather(*(self._call(c, context)
                                                  for c in reply.tool_calls))
            messages.append(reply.message())
            for call, tool in zip(reply.tool_calls, tool_replies):
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "name": call["function"]["name"], "content": tool.text})
                results.append(tool.text)
            closed = bool(resp.output_tokens) and \
                resp.output_tokens[-1] == self.tokenizer.eos_token_id
            after = text_after_reply(self.tokenizer, messages, len(messages) - 1 - len(
                tool_replies), self.schemas, kwargs, closed)
            if after is None:
                raise EpisodeRejected("the chat template does not render the tool results after "
                                      "the reply as sampled (it rewrites earlier turns)")
            delta = self.tokenizer.encode(after, add_special_tokens=False)
            limit = self.context_length
            if limit is not None and len(ids) + len(delta) + self.gconfig.max_new_tokens > limit:
                break
            ids += delta
            mask += [0] * len(delta)
            logps += [0.0] * len(delta)
            vers += [PROMPT_VERSION] * len(delta)
        self.stats.episode(replies, malformed)
        answer = self.chat.reward_text(text, self.reward_sees_reasoning, kwargs)
        reward = await call_reward(self.reward_fn, answer, {**data, "tool_results": results})
        sample = Sample(ids, mask, logps, vers, reward=reward, stop_reason=resp.stop_reason,
                        routes=routes.fit(resp.routes, len(ids)),
                        metadata={"completion_text": text, "tool_calls": len(results),
                                  "tool_results": results})
        return Trajectory([sample], group_id=str(data.get("id", "")))

    def metrics(self) -> dict[str, float]:
        return self.stats.take()

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.eval_client is not None:
            await self.eval_client.aclose()
        if self._on_close is not None:
            self._on_close()
