"""Interrupt generations on real servers with a pause + weight update, retrying a lost race
(and the vLLM suite's other helpers: a perturbed policy, a server metric).

A test starts requests, waits until the servers' own token count shows them a few tokens in,
then pauses (aborting them), updates and resumes. The pause travels through a busy API server:
on a loaded 2-core machine it has landed hundreds of tokens, once every one of a sequence's 1000
tokens, after the count passed the threshold. A round in which the pause interrupted nothing
(every sequence had already ended) is lifted without the update and run again.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable

from pathlib import Path

import httpx
import pytest
import torch

from asyncrl.api import ModelRequest, ModelResponse
from asyncrl.models.export import save_weights_dir
from asyncrl.models.loading import load_causal_lm
from asyncrl.inference.remote import RemoteInferenceEngine


def perturbed(model_dir: Path, out: Path, seed: int = 7) -> Path:
    """A copy of the model (a VLM's vision tower and processor too) with every weight moved and
    an untied output head: version 1 of the policy, as a vLLM server reloads it."""
    model = load_causal_lm(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return save_weights_dir(model.state_dict(), model.config, out, untie=True,
                            processor_from=model_dir)


def hf_logprobs(model, prompt, output, temperature=1.0) -> list[float]:
    """What the trainer computes for `output` after `prompt` (a text model, fp32)."""
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def check_served_logprobs(engine: RemoteInferenceEngine, model_dir: Path, prompt: list[int],
                          tmp: Path) -> None:
    """The servers pass their startup checks, the model check with the trainer's `model_dir`
    included, and refuse a trainer model of another shape, naming the difference; sampled tokens
    (T = 1 and 0.7, full vocabulary) carry the trainer's logprobs within 1e-4."""
    from asyncrl.api import GenerationConfig
    from asyncrl.inference.remote_errors import ServerCheckError
    from asyncrl.models.config import TinyModelConfig
    from asyncrl.models.tiny import build_tiny_model

    model = load_causal_lm(model_dir)
    other = build_tiny_model(TinyModelConfig(num_layers=2), tmp / "other_shape")

    async def run():
        await engine.check_servers(str(model_dir))
        with pytest.raises(ServerCheckError, match="num_hidden_layers 8 vs 2"):
            await engine.check_servers(str(other))
        out = {}
        for t in (1.0, 0.7):
            g = GenerationConfig(max_new_tokens=64, temperature=t, top_p=1.0, top_k=0)
            out[t] = await engine.agenerate(ModelRequest(prompt, g, rid=f"lp-{t}"))
        await engine.aclose()
        return out

    for t, resp in asyncio.run(run()).items():
        assert len(resp.output_tokens) > 0 and set(resp.output_versions) == {0}
        ours = hf_logprobs(model, prompt, resp.output_tokens, t)
        diff = max(abs(a - b) for a, b in zip(ours, resp.output_logprobs))
        assert diff < 1e-4, f"T={t}: served logprobs differ from the trainer's by {diff}"


def check_versions(responses: list[ModelResponse],
                   score: Callable[[int, ModelResponse, int], list[float]]) -> None:
    """Some sequences carry both versions, each token in order, each with the logprobs of the
    weights that sampled it (`score(i, response, version)`: the trainer's logprobs of response
    i's tokens under that version's weights)."""
    mixed = [r for r in responses if set(r.output_versions) == {0, 1}]
    assert mixed, [sorted(set(r.output_versions)) for r in responses]
    for n, r in enumerate(responses):
        assert r.stop_reason.value in ("stop", "length")
        assert r.output_versions == sorted(r.output_versions)  # v0 tokens, then v1 tokens
        for version in sorted(set(r.output_versions)):
            idx = [i for i, v in enumerate(r.output_versions) if v == version]
            ours = score(n, r, version)
            bad = [(i, round(abs(ours[i] - r.output_logprobs[i]), 4)) for i in idx
                   if abs(ours[i] - r.output_logprobs[i]) > 1e-3]
            assert not bad, (f"version {version} tokens differ from its weights at (position, "
                             f"diff) {bad[:20]}")


def _connections(port: int) -> dict[int, int]:
    """127.0.0.1 TCP connections to the server on `port`, by the client's port: the bytes the
    kernel holds on each, unsent in the server's send queue and unread in the client's receive
    queue (/proc/net/tcp)."""
    held: dict[int, int] = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = (int(a.split(":")[1], 16) for a in fields[1:3])
        tx, rx = (int(q, 16) for q in fields[4].split(":"))
        if remote == port:
            held[local] = held.get(local, 0) + rx
        elif local == port and remote:
            held[remote] = held.get(remote, 0) + tx
    return held


def _engine_processes(group: int) -> list[int]:
    """The processes of a server's group but its leader (the API server): the engine that
    generates (vLLM's EngineCore and workers, SGLang's scheduler and detokenizer)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        pid = int(stat.parent.name)
        if int(fields[2]) == group and pid != group:
            pids.append(pid)
    return pids


def kill_one_mid_generation(engine: RemoteInferenceEngine, servers,
                            requests: Callable[[int], list[ModelRequest]],
                            victim_tokens: int = 1,
                            rounds: int = 3) -> tuple[list[ModelResponse], dict]:
    """Run `requests(round)` (min_tokens = max_tokens) over two servers and SIGKILL the second
    (its process group: a lost machine) once its streams have delivered `victim_tokens` while it
    still owes a call tokens.

    On a busy machine the client parses the streams far behind the server (in CI a vLLM server
    had finished all 1000 tokens of its 8 calls while the client had read 1), and a killed
    process's sockets still deliver what it had written. So the server's engine (every process
    of its group but the API server) runs in stretches of 0.1 s between freezes (SIGSTOP), and
    while it is frozen the API server streams what it has. Once the client has read
    `victim_tokens` and still waits on a call, the API server is frozen too; when the kernel
    holds no more bytes for the client to read and the client's count has settled, a call still
    waiting can only fail: the server is killed. A round in which the server had already sent
    every call's last token is resumed (SIGCONT), finished and run again."""
    import os
    import signal

    port = int(servers.urls[1].rsplit(":", 1)[1])
    group = servers.procs[1].pid  # start_new_session: the server leads its process group
    engine_pids = _engine_processes(group)
    assert engine_pids, f"server 1 (pid {group}) has no engine process"

    def freeze(sig: signal.Signals) -> None:
        for pid in engine_pids:
            os.kill(pid, sig)

    def victim() -> tuple[int, int]:
        """Server 1 as the client sees it: tokens read from it, calls in flight there."""
        server = engine.stats()["servers"][1]
        return server["tokens"], server["in_flight"]

    # sockets of earlier engines in this process that nothing reads any more
    older = set(_connections(port))

    def queued() -> int:
        return sum(n for client, n in _connections(port).items() if client not in older)

    async def settled() -> None:
        """Wait until the server's bytes are read and parsed: the client's count, its calls in
        flight and the bytes queued in the kernel unchanged over 25 polls, the event loop (and
        so the client's streams) running between them (a frozen engine adds nothing)."""
        last, calm, deadline = None, 0, time.monotonic() + 120
        while calm < 25:
            assert time.monotonic() < deadline, (
                f"server 1's streams never settled in 120 s: {queued()} bytes queued, "
                f"{engine.stats()['servers'][1]}")
            now = (*victim(), queued())
            calm = calm + 1 if now == last else 0
            last = now
            await asyncio.sleep(0.02)

    async def run(attempt: int):
        seen = victim()[0]
        tasks = [asyncio.create_task(engine.agenerate(r)) for r in requests(attempt)]
        await _until(lambda: victim()[1] >= 1, f"server 1 never busy: {engine.stats()}", 120)
        freeze(signal.SIGSTOP)
        while True:  # run the server in short stretches until its streams delivered enough
            await settled()
            tokens, waiting = victim()
            read = tokens - seen
            if waiting == 0 or read >= victim_tokens:
                break
            freeze(signal.SIGCONT)
            time.sleep(0.1)  # blocking: the client's streams must not hold the loop meanwhile
            freeze(signal.SIGSTOP)
        os.killpg(group, signal.SIGSTOP)  # the API server too: it writes nothing more
        await settled()
        tokens, waiting = victim()
        read = tokens - seen
        kill = waiting >= 1
        os.killpg(group, signal.SIGKILL if kill else signal.SIGCONT)
        print(f"round {attempt}: server 1 frozen when the client had read {read} tokens from "
              f"it, {waiting} calls still waiting: {'killed' if kill else 'all sent, run again'}")
        return kill, await asyncio.gather(*tasks), engine.stats()

    try:
        for attempt in range(rounds):
            killed, out, stats = asyncio.run(run(attempt))
            if killed:
                return out, stats
    finally:
        engine.close()
    raise AssertionError(f"server 1 had sent every call's last token by the time its streams "
                         f"delivered {victim_tokens}, {rounds} rounds in a row")


REPO = Path(__file__).resolve().parents[2]


def train_through_local_servers(backend: str, python: str, model_dir: Path, run_dir: Path,
                                *overrides: str, config: str = "configs/train_tiny.yaml",
                                steps: int = 5) -> list[dict]:
    """`asyncrl train CONFIG` with servers of `backend` started by the job (`steps` steps, the
    logprob canary after every push, evals at step 0 and the last); its metrics rows."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "asyncrl.cli", "train", str(REPO / config),
           f"model.path={model_dir}", "inference.mode=local", f"inference.backend={backend}",
           f"inference.server_python={python}", "inference.check_logprobs_every=1",
           f"total_steps={steps}", f"eval.every={steps}", "eval.size=16",
           "filter_uniform_groups=false", "checkpoint_every=0", f"output_dir={run_dir}",
           "logging.plot=false", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checked = [r for r in rows if "weight_check/mean_abs_diff" in r]
    assert len(checked) == steps and all(r["weight_check/tokens"] > 0 for r in checked)
    assert max(r["weight_check/max_abs_diff"] for r in checked) < 1e-4  # fp32: same weights
    assert sum("eval/greedy_accuracy" in r for r in rows) == 2  # step 0 and the last
    return rows


def eval_through_a_local_server(backend: str, python: str, model_dir: Path, out: Path,
                                *args: str, problems: int = 16) -> None:
    """`asyncrl eval MODEL ARGS --backend B --server-python PY` (default args: 16 arithmetic
    problems) evaluates `problems` problems through a server it starts."""
    import json
    import subprocess
    import sys

    args = args or ("--data", "arithmetic", "--limit", str(problems))
    ev = subprocess.run([sys.executable, "-m", "asyncrl.cli", "eval", str(model_dir), *args,
                         "--backend", backend, "--server-python", python, "--json", str(out)],
                        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    assert json.loads(out.read_text())["summary"]["eval/num_problems"] == problems
    assert f"local {backend} server" in ev.stdout + ev.stderr


def metric(url: str, name: str) -> float:
    """A vLLM server's Prometheus metric `name`, summed over its label sets. (A long timeout:
    busy generating on 2 shared cores, a server's API process has taken 9 s to answer here.)"""
    text = httpx.get(url + "/metrics", timeout=60).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$",
                                                       text, re.M))


def metric_label(url: str, name: str, finished_reason: str) -> float:
    """A vLLM counter `name` for one `finished_reason` label."""
    text = httpx.get(url + "/metrics", timeout=60).text
    return sum(float(m.group(1)) for m in re.finditer(
        rf'^{re.escape(name)}{{[^}}]*finished_reason="{finished_reason}"[^}}]*}} (\S+)$', text, re.M))


async def _until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def _in_flight(engine: RemoteInferenceEngine) -> int:
    return sum(s["in_flight"] for s in engine.stats()["servers"])


async def _round(engine: RemoteInferenceEngine, requests: list[ModelRequest],
                 tokens: Callable[[], float], after: float,
                 update: Callable[[], Awaitable[None]]) -> tuple[int, list[ModelResponse]]:
    start = tokens()
    tasks = [asyncio.create_task(engine.agenerate(r)) for r in requests]
    # the servers' count: the client parses the streams behind the servers' progress
    while tokens() < start + after:
        assert not all(t.done() for t in tasks), "every sequence ended before the update"
        await asyncio.sleep(0.02)
    engine.pause()
    try:
        # every call returns: aborted ones (some servers end the stream without a reason)
        # wait in the client to continue; the others have finished
        await _until(lambda: _in_flight(engine) == 0, "the paused servers kept requests")
        await asyncio.sleep(0.1)  # for the finished calls' tasks to complete
        interrupted = sum(not t.done() for t in tasks)
        if interrupted:
            await update()
    finally:
        engine.resume()
    return interrupted, list(await asyncio.gather(*tasks))


def interrupt_with_update(engine: RemoteInferenceEngine,
                          requests: Callable[[int], list[ModelRequest]],
                          tokens: Callable[[], float], after: float,
                          update: Callable[[], Awaitable[None]],
                          rounds: int = 3) -> list[ModelResponse]:
    """Run `requests(round)` and apply `update` mid-generation once `tokens()` (the servers'
    generated-token count) has grown by `after`; returns the responses of the round in which
    the pause interrupted at least one sequence (each round on its own event loop)."""
    for attempt in range(rounds):
        interrupted, responses = asyncio.run(
            _round(engine, requests(attempt), tokens, after, update))
        print(f"round {attempt}: the pause interrupted {interrupted} of {len(responses)} "
              "sequences")
        if interrupted:
            return responses
    raise AssertionError(f"the pause landed after every sequence ended, {rounds} rounds in a row")
