"""Weight sync trainer -> engines through the job's one path (`RolloutEngines.push`, which calls
`InferenceEngine.update_weights(meta, weights)` on every engine): in process, HTTP buckets and
disk against a real `asyncrl serve`; and a gloo broadcast between two real processes on 127.0.0.1
(the CPU stand-in for the NCCL path on GPU clusters)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from asyncrl.api import (
    GenerationConfig,
    ModelRequest,
    WeightUpdateKind,
    WeightUpdateMeta,
)
from asyncrl.inference.engine import LLMEngine
from asyncrl.inference.config import EngineSettings
from asyncrl.launch.serve import READY_PREFIX
from asyncrl.models.loading import load_causal_lm, load_tokenizer
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.train.logprobs import gather_logprobs
from asyncrl.inference.config import RemoteEngineConfig
from asyncrl.launch.launchers import LocalLauncher
from asyncrl.launch.local_servers import LocalServers
from asyncrl.launch.run_events import RunEvents
from train_helpers import server_command
from asyncrl.launch.rollout_engines import open_rollout_engines
from asyncrl.launch.train_config import InferenceLaunchConfig
from asyncrl.models.export import save_weights_dir
from asyncrl.inference.weight_group import (
    DistributedWeightReceiver,
    DistributedWeightSender,
    TensorSpec,
    decode_spec,
    encode_spec,
    plan_buckets,
    spec_of,
)

TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_size=128, seed=5)
PROMPT = [11, 12, 13, 14]
NEW = 6
KEY = "sync-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(TINY, tmp_path_factory.mktemp("tiny") / "m"))


def perturbed(model_dir, scale=0.3, seed=0):
    """The 'trained' policy: the engine's starting weights moved far enough to change logprobs."""
    model = load_causal_lm(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def greedy(engine: LLMEngine) -> tuple[list[int], list[float], list[int]]:
    req = ModelRequest(PROMPT, GenerationConfig(max_new_tokens=NEW, greedy=True))
    out = engine.generate([req])[0]
    return out.output_tokens, out.output_logprobs, out.output_versions


@torch.no_grad()
def trainer_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """What the trainer's model assigns to the engine's output tokens after PROMPT."""
    ids = torch.tensor([PROMPT + tokens])
    logits = model(input_ids=ids, use_cache=False).logits[0]
    return gather_logprobs(logits[len(PROMPT) - 1:-1], ids[0, len(PROMPT):])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- spec and buckets ----------------------------------------------------------------------

def test_spec_round_trips_and_buckets_split_by_size_and_dtype():
    sd = {"b": torch.zeros(10), "a": torch.zeros(3, 4), "c": torch.zeros(5, dtype=torch.bfloat16),
          "d": torch.zeros(100)}
    spec = spec_of(sd)
    assert [s.name for s in spec] == ["a", "b", "c", "d"]  # fixed order, not dict order
    assert decode_spec(encode_spec(spec, 123)) == (spec, 123)
    buckets = plan_buckets(spec, bucket_bytes=60)  # a: 48 B, b: 40 B
    assert [[s.name for s in b] for b in buckets] == [["a"], ["b"], ["c"], ["d"]]
    assert [[s.name for s in b] for b in plan_buckets(spec, 1 << 20)] == [["a", "b"], ["c"], ["d"]]
    assert TensorSpec("x", (2, 3), torch.bfloat16).nbytes == 12


def test_bad_group_settings_name_the_field():
    meta = WeightUpdateMeta(kind=WeightUpdateKind.DISTRIBUTED, version=0, world_size=2,
                            master_port=0, backend="gloo")
    with pytest.raises(ValueError, match="master_port=0"):
        DistributedWeightReceiver(meta, rank=1)
    with pytest.raises(ValueError, match="rank=0"):
        DistributedWeightReceiver(meta, rank=0)
    with pytest.raises(ValueError, match="kind='tensors'"):
        DistributedWeightSender(WeightUpdateMeta.from_tensors(0), {"a": torch.zeros(1)})


# ---- in-process ----------------------------------------------------------------------------

def test_in_process_push_updates_the_engine(model_dir, tmp_path):
    model = perturbed(model_dir, seed=1)
    cfg = InferenceLaunchConfig(engine=EngineSettings(max_num_seqs=2))
    with open_rollout_engines(cfg, model_dir, tmp_path / "logs", LocalLauncher()) as engines:
        e = engines.engine
        asyncio.run(engines.push(model.state_dict(), 3))
        assert e.get_version() == 3
        # Stop the engine thread before driving its LLMEngine from this thread: an idle
        # thread still steps, and a request added here could be finished twice.
        e.shutdown()
        tokens, logprobs, versions = greedy(e.engine)
        assert versions == [3] * NEW
        torch.testing.assert_close(torch.tensor(logprobs), trainer_logprobs(model, tokens),
                                   atol=1e-4, rtol=0)


def test_in_process_canary_stops_a_corrupted_push(model_dir, tmp_path):
    """The logprob canary runs after every push in process too (it used to run only against
    servers): weights altered on the way (here one tensor scaled) end the push with an error
    naming the engine and the difference."""
    from asyncrl.launch.weight_check import LogprobCheck, WeightCheckError

    model = perturbed(model_dir, seed=1)

    def score(prompt, output, images=None):
        assert prompt == PROMPT
        return trainer_logprobs(model, output).tolist()

    cfg = InferenceLaunchConfig(engine=EngineSettings(max_num_seqs=2), check_logprobs_every=1)
    assert InferenceLaunchConfig().canary_every == 20  # in process, by default every 20th push
    with open_rollout_engines(cfg, model_dir, tmp_path / "logs", LocalLauncher()) as engines:
        engines.check = LogprobCheck(score, [PROMPT], 1.0, 0.05)
        ok = asyncio.run(engines.push(model.state_dict(), 1))
        assert ok["weight_check/tokens"] > 0 and ok["weight_check/mean_abs_diff"] < 1e-4
        sent = dict(model.state_dict())
        name = next(k for k in sent if k.endswith("mlp.down_proj.weight"))
        sent[name] = sent[name] * 3.0  # what a broken transfer might deliver
        with pytest.raises(WeightCheckError, match=r"the in-process engine at weight version 2: "
                                                   r"its logprobs differ .* by \d"):
            asyncio.run(engines.push(sent, 2))


# ---- HTTP buckets and disk, against a real server ------------------------------------------

@pytest.fixture(scope="module")
def server(model_dir):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "serve", "--model", model_dir, "--port", "0",
         "--api-key", KEY, "engine.max_seq_len=64", "engine.max_num_seqs=2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith(READY_PREFIX):
        proc.kill()
        pytest.fail(f"server did not start: {line!r} {proc.stderr.read()[-3000:]}")
    yield line[len(READY_PREFIX):].strip()
    proc.terminate()
    proc.wait(timeout=20)


def server_greedy(url: str) -> dict:
    import httpx

    body = {"input_ids": PROMPT, "max_new_tokens": NEW, "greedy": True}
    return httpx.post(url + "/generate", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}).json()


@pytest.mark.parametrize("kind, version", [("tensors", 4), ("disk", 5), ("gloo", 6)])
def test_http_disk_and_broadcast_push_reach_the_server(server, model_dir, tmp_path, kind,
                                                      version):
    """gloo: the trainer forms a weight group with the server (POST /weights/join_group) and
    broadcasts buckets while the server's /weights/update_distributed call receives them: the
    NCCL path on GPUs, with the backend switched."""
    model = perturbed(model_dir, seed=version)
    cfg = InferenceLaunchConfig(mode="remote", weight_sync=kind, bucket_bytes=1 << 16,
                                remote=RemoteEngineConfig(addresses=[server], api_key=KEY))

    async def push(engines):
        await engines.push(model.state_dict(), version)
        await engines.engine.aclose()

    with open_rollout_engines(cfg, model_dir, tmp_path / "logs", LocalLauncher()) as engines:
        asyncio.run(push(engines))
    assert (tmp_path / "weights" / f"v{version}" / "config.json").is_file() == (kind == "disk")
    got = server_greedy(server)
    assert got["output_versions"] == [version] * NEW
    torch.testing.assert_close(torch.tensor(got["output_logprobs"]),
                               trainer_logprobs(model, got["output_tokens"]), atol=1e-4, rtol=0)


def test_state_dict_dirs_reload_the_exact_tokenizer(model_dir, tmp_path):
    """Checkpoint / disk-sync dirs once saved the tokenizer as transformers 5's
    "TokenizersBackend"; AutoTokenizer then built a Qwen2Tokenizer from the model type, which
    changed how tool-call text and spaces tokenized (a trained tool agent measured 0% calls)."""
    from transformers import AutoModelForCausalLM

    from asyncrl.models.tokenizer import build_byte_tokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out = save_weights_dir(model.state_dict(), model.config, tmp_path / "ckpt",
                              tokenizer=load_tokenizer(model_dir))
    text = 'a b <tool_call>{"name": "calc"}</tool_call><|im_end|>'
    assert load_tokenizer(out).encode(text) == build_byte_tokenizer().encode(text)


def test_broadcast_sync_survives_a_killed_server(model_dir, tmp_path):
    """Two real servers in one gloo weight group: two pushes use one group; then one server is
    SIGKILLed and the next push forms a group of the survivor and reaches it (the dead one is
    reported as missing the update, not a failed job). The failure is a `server` event on the
    run's timeline (what `asyncrl view` shows)."""
    engine = EngineSettings(max_num_seqs=2, max_seq_len=64, num_threads=1)

    async def push(engines, version):
        model = perturbed(model_dir, seed=version)
        await engines.push(model.state_dict(), version)
        return model

    async def run(engines, servers):
        await push(engines, 1)
        model = await push(engines, 2)
        group = engines.engine._weights._group
        assert group.groups_formed == 1 and len(group.members) == 2
        for url in engines.urls:
            got = server_greedy_nokey(url, servers.api_key)
            assert got["output_versions"] == [2] * NEW
            torch.testing.assert_close(torch.tensor(got["output_logprobs"]),
                                       trainer_logprobs(model, got["output_tokens"]),
                                       atol=1e-4, rtol=0)
        os.killpg(servers.procs[0].pid, signal.SIGKILL)  # a lost machine
        model = await push(engines, 3)
        assert group.groups_formed == 2 and len(group.members) == 1
        got = server_greedy_nokey(engines.urls[1], servers.api_key)
        assert got["output_versions"] == [3] * NEW
        torch.testing.assert_close(torch.tensor(got["output_logprobs"]),
                                   trainer_logprobs(model, got["output_tokens"]),
                                   atol=1e-4, rtol=0)
        await engines.engine.aclose()

    make = lambda key: server_command("asyncrl", model_dir, api_key=key, engine=engine)  # noqa: E731
    with LocalServers(make, 2, tmp_path / "logs") as servers, RunEvents(tmp_path) as events, \
            events.capture():
        cfg = InferenceLaunchConfig(mode="remote", weight_sync="gloo", bucket_bytes=1 << 16,
                                    remote=RemoteEngineConfig(addresses=servers.urls,
                                                              api_key=servers.api_key))
        with open_rollout_engines(cfg, model_dir, tmp_path / "logs", LocalLauncher()) as engines:
            asyncio.run(run(engines, servers))
    timeline = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "server" and "weight update to version 3 failed on 1 of 2 server(s)"
               in e["message"] for e in timeline), timeline


def server_greedy_nokey(url: str, key: str | None) -> dict:
    import httpx

    body = {"input_ids": PROMPT, "max_new_tokens": NEW, "greedy": True}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/generate", json=body, timeout=60, headers=headers).json()


def test_group_routes_refuse_bad_calls_clearly(server):
    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "rank_offset": 2}
    r = httpx.post(server + "/weights/join_group", json=body, headers=headers)
    assert r.status_code == 400 and "rank_offset=2 is out of range; allowed [1, 1]" in r.text
    # nobody listens on the port: the rendezvous fails within the timeout, as a 503 naming it
    # (and the server leaves any group it was in: a new join replaces the group)
    body.update(rank_offset=1, master_port=free_port(), timeout_s=1, backend="gloo")
    r = httpx.post(server + "/weights/join_group", json=body, headers=headers, timeout=30)
    assert r.status_code == 503 and "could not join the weight group at 127.0.0.1" in r.text
    r = httpx.post(server + "/weights/update_distributed", json={"version": 1}, headers=headers)
    assert r.status_code == 409 and "POST /weights/join_group first" in r.text
