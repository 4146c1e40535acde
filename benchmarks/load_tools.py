"""Load: many tool-calling episodes in flight at once, waiting on the tool service, for minutes.

Holds `--in-flight` episodes in the real rollout executor (each finished one is replaced by a new
row) against the real in-process engine and a real tool service subprocess, and checks that
nothing is lost or duplicated (every submitted row comes back exactly once) and that the
process's RSS and open file descriptors (and the service's) stay flat. `--mode workflow` runs
the `tool_calls` workflow; `--mode proxy` runs the calculator agent (examples/tool_agent) with
the `openai` SDK through the proxy, calling the same service over HTTP.

    python benchmarks/load_tools.py --mode workflow --in-flight 512 --minutes 10 \
        --record benchmarks/results/load_tools_workflow.json
    python benchmarks/load_tools.py --mode proxy --in-flight 512 --minutes 10 \
        --record benchmarks/results/load_tools_proxy.json

The policy is the calculator agent's warm start (examples/tool_agent/sft.yaml, trained first if
it is not cached), so episodes really call the calculator (a call is about 60 tokens: replies get
80); `--model DIR` takes another. The record counts the calls the service answered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # examples.tool_agent


def rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def warm_start() -> Path:
    """The calculator agent's warm start (examples/tool_agent/sft.yaml: it writes calc calls;
    cached, trained first when missing; its data comes from examples.tool_agent.make_data)."""
    import yaml

    from asyncrl.launch.sft import run_sft_job
    from asyncrl.launch.sft_config import SFTRunConfig

    if not (ROOT / "examples" / "tool_agent" / "data" / "sft.jsonl").is_file():
        from examples.tool_agent.make_data import make_files

        make_files(ROOT / "examples" / "tool_agent" / "data", 0)
    path = ROOT / "examples" / "tool_agent" / "sft.yaml"
    cfg = SFTRunConfig.from_dict(yaml.safe_load(path.read_text()), source=str(path))
    return Path(run_sft_job(cfg).model_dir)


def service_stats(url: str) -> dict:
    """The tool service's own counts (GET /stats: calls by fate, service-time median/p99)."""
    import httpx

    return httpx.get(f"{url}/stats", timeout=30.0).json()


def rows_from(n: int):
    """Endless distinct prompts (ids never repeat): a*b over every pair, then again."""
    k = 0
    while True:
        for a in range(10, 100):
            for b in range(10, 100):
                yield {"id": f"load-{k}", "messages": [{"role": "user", "content": f"{a}*{b}=?"}],
                       "answer": str(a * b)}
                k += 1
                if k >= n:
                    return


def run_load(mode: str, model_dir: Path, in_flight: int, seconds: float, service: dict,
             sample_every: float = 10.0, max_new_tokens: int = 80, say=print,
             engine=None) -> dict:
    """Holds `in_flight` episodes for `seconds`, then drains; the counts and the RSS/fd samples.
    Rows are submitted with distinct ids; each accepted trajectory names its row (group_id).
    `engine`: another InferenceEngine (a test's scripted policy); None: the built-in engine on
    `model_dir`."""
    from asyncrl.api import GenerationConfig
    from asyncrl.inference.async_engine import AsyncLLMEngine
    from asyncrl.inference.engine import EngineConfig
    from asyncrl.models.loading import load_tokenizer
    from asyncrl.rollout.calculator import TOOLS
    from asyncrl.rollout.executor import RolloutConfig, WorkflowExecutor
    from asyncrl.rollout.tool_service import ToolServiceConfig, ToolServiceProcess

    tokenizer = load_tokenizer(model_dir)
    own_engine = engine is None
    if own_engine:
        engine = AsyncLLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=512,
                                             max_num_seqs=min(in_flight, 256)))
    proc = ToolServiceProcess(ToolServiceConfig(**service))
    gconfig = GenerationConfig(max_new_tokens=max_new_tokens)
    if mode == "workflow":
        from asyncrl.rollout.tool_calling import ToolCallingWorkflow
        from examples.tool_agent.task import episode_reward

        workflow = ToolCallingWorkflow(episode_reward, gconfig, tokenizer, proc.client(), TOOLS)
    else:
        from asyncrl.proxy.config import AgentConfig, ProxyConfig
        from asyncrl.proxy.server import ProxyServer
        from asyncrl.proxy.workflow import AgentWorkflow
        from examples.tool_agent.agent import CalculatorAgent

        proxy = ProxyServer(engine, tokenizer, ProxyConfig(max_sessions=2 * in_flight,
                                                           max_tokens_cap=max_new_tokens),
                            context_length=512)
        agent = CalculatorAgent(max_tokens=max_new_tokens, tool_url=proc.url,
                                tool_timeout_s=service.get("client_timeout_s", 30.0))
        workflow = AgentWorkflow(agent, proxy, AgentConfig(timeout_s=600.0))
    batch = max(1, min(64, in_flight // 8))  # finished episodes taken (and replaced) at once
    # no staleness limit: the load is bounded by max_concurrent_rollouts alone, and nothing is
    # dropped as stale (that would be by design, not lost)
    rcfg = RolloutConfig(batch_size=batch, max_concurrent_rollouts=in_flight,
                         max_head_offpolicyness=10**9)
    rows = rows_from(10**9)
    submitted: list[str] = []
    seen: dict[str, int] = {}
    called = [0]  # episodes whose trajectory holds a tool result (the workflow's metadata)
    samples: list[dict] = []
    t0 = time.monotonic()
    with WorkflowExecutor(engine, rcfg, workflow) as ex:
        def submit(k: int) -> None:
            for _ in range(k):
                row = next(rows)
                submitted.append(row["id"])
                ex.submit(row)

        def take(k: int, timeout: float) -> int:
            trajs = ex.wait(k, timeout=timeout)
            for traj in trajs:
                seen[traj.group_id] = seen.get(traj.group_id, 0) + 1
                called[0] += any(s.metadata.get("tool_calls", 0) for s in traj.samples)
            return len(trajs)

        submit(in_flight)
        next_sample = t0
        while time.monotonic() - t0 < seconds:
            if time.monotonic() >= next_sample:
                st = ex.stats()
                samples.append({"t": round(time.monotonic() - t0, 1), "rss_mib": round(
                    rss_mib(), 1), "fds": open_fds(), "service_rss_mib": round(
                    rss_mib(proc.proc.pid), 1), "service_fds": open_fds(proc.proc.pid),
                    "running": st["running"], "pending": st["pending"],
                    "service_calls": sum(service_stats(proc.url)["calls"].values()),
                    "finished": st["accepted"] + st["rejected"] + st["failed"]})
                say(f"{samples[-1]}")
                next_sample += sample_every
            got = take(batch, timeout=5.0) if ex.stats()["ready"] >= batch else 0
            if got:
                submit(got)
            else:
                time.sleep(0.05)
        # drain: everything submitted comes back once
        deadline = time.monotonic() + 600
        while sum(seen.values()) < len(submitted) and time.monotonic() < deadline:
            st = ex.stats()
            if st["rejected"] + st["failed"] + sum(seen.values()) >= len(submitted):
                break
            if st["ready"]:
                take(st["ready"], timeout=5.0)
            else:
                time.sleep(0.05)
        stats = ex.stats()
        ex.run(workflow.aclose())
    if own_engine:
        engine.shutdown()
    service_calls = service_stats(proc.url)["calls"]
    proc.stop()
    lost = [i for i in submitted if i not in seen]
    duplicated = [i for i, n in seen.items() if n > 1]
    unknown = [i for i in seen if i not in set(submitted)]
    return {"mode": mode, "in_flight": in_flight, "seconds": seconds, "service": service,
            "submitted": len(submitted), "returned": sum(seen.values()), "lost": len(lost),
            "duplicated": len(duplicated), "unknown": len(unknown),
            "rejected": stats["rejected"], "failed": stats["failed"],
            # what the service answered, by fate (answer, error = injected 503, hang, ...): the
            # episodes did wait on it; calls per returned episode says how many called
            "service_calls": service_calls,
            "service_calls_per_episode": round(sum(service_calls.values()) / max(
                sum(seen.values()), 1), 3),
            "episodes_with_tool_result": called[0] if mode == "workflow" else None,
            "episodes_per_s": round(len(submitted) / max(time.monotonic() - t0, 1e-9), 2),
            **minute_means(samples, seconds), "samples": samples}


def minute_means(samples: list[dict], seconds: float) -> dict[str, float]:
    """Each resource's mean over the first and the last minute of load. The first minute starts
    after the t = 0 sample, taken before any episode ran (the engine and the service idle)."""
    first = [s for s in samples if 0.0 < s["t"] <= 60.0] or samples[:1]
    last = [s for s in samples if s["t"] >= seconds - 60.0] or samples[-1:]
    return {f"{key}_{name}_minute": round(sum(s[key] for s in window) / len(window), 1)
            for key in ("rss_mib", "fds", "service_rss_mib", "service_fds")
            for name, window in (("first", first), ("last", last))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("workflow", "proxy"), default="workflow")
    ap.add_argument("--in-flight", type=int, default=512)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--median-s", type=float, default=2.0, help="tool service time, median")
    ap.add_argument("--tail", type=float, default=5.0, help="tool service time, p99 / median")
    ap.add_argument("--error-rate", type=float, default=0.02, help="injected 503s")
    ap.add_argument("--model", default=None, help="model dir (default: the tool warm start)")
    ap.add_argument("--record", default=None, help="write the result here as JSON")
    args = ap.parse_args()
    model = Path(args.model) if args.model else warm_start()
    service = {"median_s": args.median_s, "p99_over_median": args.tail,
               "error_rate": args.error_rate, "seed": 0}
    out = run_load(args.mode, model, args.in_flight, args.minutes * 60, service)
    out["command"] = " ".join(["python", *sys.argv])
    summary = {k: v for k, v in out.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    if args.record:
        Path(args.record).write_text(json.dumps(out, indent=1))
    ok = out["lost"] == out["duplicated"] == out["unknown"] == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
