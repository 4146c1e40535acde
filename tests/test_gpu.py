"""Checks that need CUDA (marker `gpu`; skipped with the reason on a machine without it).

The engine's own CUDA checks (logprobs equal transformers' in bf16, sampling) are in
tests/test_engine_device.py. Here: the main loop on the GPU, and a weight push over NCCL of the
Qwen2.5-0.5B-shaped model to a real `asyncrl serve` on a second GPU (NCCL refuses two ranks of
one group on one device, so that test needs two).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch
from test_train_loop import small_config
from train_helpers import digit_reward

from asyncrl import Trainer

pytestmark = pytest.mark.gpu


def test_main_loop_five_steps_on_cuda(model_dir, tmp_path):
    """Trainer and in-process engine both on the GPU (device auto), bf16 autocast."""
    cfg = small_config(model_dir, tmp_path / "run", total_steps=5,
                       **{"train.autocast_dtype": "bfloat16", "eval.every": 0})
    torch.cuda.reset_peak_memory_stats()
    result = Trainer(cfg).train(reward=digit_reward)
    assert result.steps == 5 and result.stopped_by == "total_steps"
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "reward/mean" in m]
    assert [m["policy/version"] for m in steps] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(m["loss/total"] == m["loss/total"] for m in steps if "loss/total" in m)  # no NaN
    assert torch.cuda.max_memory_allocated() > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL needs the trainer and the server on two different GPUs")
def test_nccl_push_of_the_05b_model_to_a_server(tmp_path):
    """Trainer (GPU 0) -> `asyncrl serve` (GPU 1) over NCCL: the served logprobs equal the
    trainer's after the push (bf16 tolerance 0.05, as in test_engine_device.py)."""
    from asyncrl.inference.config import RemoteEngineConfig
    from asyncrl.launch.launchers import LocalLauncher
    from asyncrl.launch.rollout_engines import open_rollout_engines
    from asyncrl.launch.train_config import InferenceLaunchConfig
    from asyncrl.models.loading import load_causal_lm
    from asyncrl.models.presets import ensure_preset_model

    model_dir = ensure_preset_model("qwen2.5-0.5b")
    cfg = InferenceLaunchConfig.from_dict({
        "mode": "local", "weight_sync": "nccl",
        "engine": {"max_num_seqs": 4, "max_seq_len": 256, "device": "cuda:1"}})
    model = load_causal_lm(model_dir, dtype="bfloat16").to("cuda:0")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    state = {k: v.detach() for k, v in model.state_dict().items()}

    async def push(engines):
        t0 = time.perf_counter()
        await engines.push(state, 1)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        await engines.push(state, 2)
        print(f"NCCL push of {sum(v.numel() for v in state.values()) / 1e6:.0f}M parameters: "
              f"first (forms the group) {first:.2f}s, second {time.perf_counter() - t0:.2f}s")
        await engines.engine.aclose()

    with open_rollout_engines(cfg, model_dir, tmp_path / "logs", LocalLauncher()) as engines:
        asyncio.run(push(engines))
        assert isinstance(engines.engine.cfg, RemoteEngineConfig)
        import httpx

        prompt = list(range(100, 116))
        got = httpx.post(engines.urls[0] + "/generate", timeout=120,
                         headers={"Authorization": f"Bearer {engines.servers.api_key}"},
                         json={"input_ids": prompt, "max_new_tokens": 8, "greedy": True}).json()
    assert got["output_versions"] == [2] * 8
    ids = torch.tensor([prompt + got["output_tokens"]], device="cuda:0")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    ours = torch.log_softmax(logits, -1).gather(
        -1, torch.tensor(got["output_tokens"], device="cuda:0")[:, None])[:, 0]
    assert (ours.cpu() - torch.tensor(got["output_logprobs"])).abs().max() < 0.05
    assert Path(model_dir, "config.json").is_file()
