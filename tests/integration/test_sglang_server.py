"""The SGLang backend against real SGLang servers (sglang 0.5.23 on its torch-native CPU path, a
cached venv built by sglang_venv.py with two stand-in modules) serving a tiny Qwen2 model on
127.0.0.1: exact logprobs, interruption by a weight update (from disk and by the gloo broadcast
group) with per-token versions, abort of exactly the named request, a SIGKILLed server
mid-generation, and `asyncrl train` / `asyncrl eval` through locally launched SGLang servers.

Run: `python -m pytest -m sglang tests/integration` (.ci/run does, after the vLLM suite).
Nothing is mocked. Tests run in file order; the failover test kills a server and comes last among
those sharing the module's servers.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from asyncrl.api import GenerationConfig, ModelRequest, WeightUpdateMeta
from asyncrl.inference.config import EngineSettings, RemoteEngineConfig
from asyncrl.inference.remote import RemoteInferenceEngine
from asyncrl.launch.local_servers import LocalServers
from asyncrl.launch.weight_check import LogprobCheck
from asyncrl.models.config import TinyModelConfig
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.tiny import build_tiny_model
from train_helpers import make_backend, server_command

sys.path.insert(0, str(Path(__file__).parent))
from pause_rounds import (  # noqa: E402
    check_served_logprobs,
    check_versions,
    eval_through_a_local_server,
    hf_logprobs,
    interrupt_with_update,
    kill_one_mid_generation,
    perturbed,
    train_through_local_servers,
)
from sglang_venv import ensure_sglang_python  # noqa: E402

pytestmark = pytest.mark.sglang

TINY = TinyModelConfig(seed=3)  # the embedded default's shape (see test_vllm_server.py)
KEY = "-sglang-test-key"  # a leading "-": the job passes it as one --api-key=KEY argument
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def sglang_python():
    return ensure_sglang_python()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TINY, tmp_path_factory.mktemp("sglang_model") / "tiny")


@pytest.fixture(scope="module")
def servers(sglang_python, model_dir, tmp_path_factory):
    """Two SGLang servers of the tiny model, started as the job starts them."""
    make = lambda key: server_command("sglang", str(model_dir), python=sglang_python,  # noqa: E731
                                      engine=EngineSettings(max_num_seqs=16), api_key=key)
    with LocalServers(make, 2, tmp_path_factory.mktemp("sglang_logs"), 300, api_key=KEY) as s:
        yield s


def engine_for(urls, **kw) -> RemoteInferenceEngine:
    return RemoteInferenceEngine(RemoteEngineConfig(addresses=list(urls), api_key=KEY, **kw),
                                 make_backend("sglang"))


def scorer(model):
    return lambda prompt, output, images=None: hf_logprobs(model, prompt, output)


def received(engine) -> float:
    """Tokens the client has received so far (its streams: SGLang's /metrics needs a flag)."""
    return float(sum(s["tokens"] for s in engine.stats()["servers"]))


def test_startup_checks_pass_and_logprobs_equal_the_trainers(servers, model_dir, tmp_path):
    check_served_logprobs(engine_for(servers.urls[:1]), model_dir, PROMPT, tmp_path)


def test_pause_update_resume_gives_both_versions_with_matching_logprobs(servers, model_dir,
                                                                        tmp_path):
    """Disk update mid-generation: /pause_generation (abort) returns partial outputs, the
    servers load v1 and report it, and every sequence continues; its tokens carry the version
    that sampled them, each with that version's logprobs. Then the weight canary passes."""
    v0, v1_dir = load_causal_lm(model_dir), perturbed(model_dir, tmp_path / "v1")
    v1 = load_causal_lm(v1_dir)
    engine = engine_for(servers.urls)
    g = GenerationConfig(max_new_tokens=300, temperature=1.0)
    responses = interrupt_with_update(
        engine, lambda k: [ModelRequest(PROMPT, g, rid=f"mix-{k}-{i}") for i in range(8)],
        tokens=lambda: received(engine), after=200,
        update=lambda: engine.update_weights(WeightUpdateMeta.from_disk(str(v1_dir), 1)))
    check_versions(responses, lambda i, r, v: hf_logprobs((v0, v1)[v], PROMPT, r.output_tokens))
    check = LogprobCheck(scorer(v1), [PROMPT], 1.0, 1e-3)
    metrics = asyncio.run(check.run(engine, 1))
    engine.close()
    assert metrics["weight_check/mean_abs_diff"] < 1e-4 and metrics["weight_check/tokens"] > 0


def test_abort_stops_exactly_the_named_request(servers):
    """Cancelling request r1 aborts r1 on the server and not r10 (SGLang matches abort ids by
    prefix; the backend terminates each id): r10 runs to its end without an interruption."""
    engine = engine_for(servers.urls[:1])
    g = GenerationConfig(max_new_tokens=400, min_new_tokens=400, temperature=1.0)

    async def run():
        tasks = {rid: asyncio.create_task(engine.agenerate(ModelRequest(PROMPT, g, rid=rid)))
                 for rid in ("r1", "r10")}
        deadline = time.monotonic() + 120
        while received(engine) < 40:
            assert time.monotonic() < deadline, engine.stats()
            await asyncio.sleep(0.02)
        tasks["r1"].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks["r1"]
        return await tasks["r10"]

    r10 = asyncio.run(run())
    stats = engine.stats()
    engine.close()
    assert r10.output_len == 400 and r10.stop_reason.value == "length"
    assert "continuations" not in stats and "failed_calls" not in stats, stats


def test_killed_server_mid_generation_loses_no_request(servers):
    """SIGKILL one of two servers while both generate: its requests finish on the other, from
    the tokens its streams had already delivered."""
    engine = engine_for(servers.urls, max_retries=8, backoff_base_s=0.05, backoff_max_s=0.5)
    g = GenerationConfig(max_new_tokens=600, min_new_tokens=600, temperature=1.0)
    responses, stats = kill_one_mid_generation(
        engine, servers, lambda k: [ModelRequest(PROMPT, g, rid=f"k-{k}-{i}") for i in range(8)],
        victim_tokens=100)
    assert all(len(r.output_tokens) == 600 for r in responses), [len(r.output_tokens)
                                                                 for r in responses]
    assert stats.get("failed_calls", 0) >= 1, stats
    assert stats["tokens_kept_from_failed_calls"] >= 1  # streamed tokens were kept
    assert stats["servers"][1]["health"] == "unhealthy"


def test_a_restarted_server_serves_once_it_has_the_current_weights(servers, sglang_python,
                                                                   model_dir, tmp_path):
    """Server 1 was SIGKILLed (the test above); a fresh one takes its place at weight version
    "default". It stays out of rotation while the client is at version 1, and serves once the
    next update (version 2) has reached it, with version 2's logprobs."""
    v2_dir = perturbed(model_dir, tmp_path / "v2", seed=11)
    engine = engine_for(servers.urls)
    asyncio.run(engine.update_weights(WeightUpdateMeta.from_disk(str(v2_dir), 1)))  # server 0
    make = lambda key: server_command("sglang", str(model_dir), python=sglang_python,  # noqa: E731
                                      engine=EngineSettings(max_num_seqs=16), api_key=key)
    with LocalServers(make, 1, tmp_path / "logs", 300, api_key=KEY) as fresh:
        engine.replace_server(1, fresh.urls[0])
        g = GenerationConfig(max_new_tokens=8, temperature=1.0)

        async def spread(tag: str) -> list:
            return await asyncio.gather(*(engine.agenerate(ModelRequest(PROMPT, g,
                                                                        rid=f"{tag}-{i}"))
                                          for i in range(6)))

        asyncio.run(spread("before"))
        assert engine.stats()["servers"][1]["requests"] == 0  # out of rotation at version 0
        asyncio.run(engine.update_weights(WeightUpdateMeta.from_disk(str(v2_dir), 2)))
        check = LogprobCheck(scorer(load_causal_lm(v2_dir)), [PROMPT], 1.0, 1e-3)
        metrics = asyncio.run(check.run(engine, 2))  # probes both servers
        asyncio.run(spread("after"))
        stats = engine.stats()
        engine.close()
    assert metrics["weight_check/mean_abs_diff"] < 1e-4
    assert stats["servers"][1]["requests"] > 0 and stats["servers"][1]["version"] == 2


@pytest.mark.parametrize("sync", ["disk", "gloo"])
def test_train_and_eval_through_local_sglang_servers(sglang_python, model_dir, tmp_path, sync):
    """`asyncrl train configs/train_tiny.yaml inference.mode=local inference.backend=sglang`:
    5 steps, weights pushed by directory or over the gloo broadcast group and checked by the
    logprob canary after each push, evals through SGLang; then `asyncrl eval --backend sglang`.
    (The tiny random model stands in for the SFT warm start, which takes minutes to build.)"""
    train_through_local_servers("sglang", sglang_python, model_dir, tmp_path / "run",
                                f"inference.weight_sync={sync}")
    if sync == "disk":
        eval_through_a_local_server("sglang", sglang_python, model_dir, tmp_path / "ev.json")
