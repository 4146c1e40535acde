"""FSDP2 on 2 gloo processes gives the same step as one process.

The test launches this file under torchrun (`__main__` below is the per-rank worker), then
repeats the step in-process with `HFTrainEngine` and compares weights and logprobs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from asyncrl.api.trajectory import Sample
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model
from asyncrl.train.engine import HFTrainEngine, TrainEngineConfig, sft_token_loss
from asyncrl.train.optim import OptimizerConfig
from asyncrl.train.packing import build_micro_batches, shared_prefix_layout

TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_size=128)
# Small Adam lr and a larger eps keep weight comparisons meaningful: see test_train_engine.py.
CFG = TrainEngineConfig(max_tokens_per_mb=16, total_steps=10,
                        optimizer=OptimizerConfig(lr=1e-3, eps=1e-6, grad_clip=1.0))
# Uneven lengths: on their own the two ranks would pack 2 and 3 micro-batches; they must agree
# on 3 or the FSDP collectives inside forward/backward would deadlock.
LENGTHS = [11, 15, 11, 3, 8, 3, 7]  # rank 0: 2 micro-batches, rank 1: 3
STEPS = 2


def make_samples() -> list[Sample]:
    """Samples 0 and 2 share a prompt: the single process computes it once (share_prefixes),
    FSDP ranks compute it per sample; gradients and trained logprobs must agree."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, 60, (n,), generator=g).tolist()
        p = max(1, n // 3)
        if len(out) == 2:
            ids[:p] = out[0].input_ids[:p]
        out.append(Sample.from_prompt_and_completion(ids[:p], ids[p:], [-1.0] * (n - p),
                                                     [0] * (n - p)))
    return out


def run_steps(engine: HFTrainEngine) -> tuple[list[dict[str, float]], list[torch.Tensor]]:
    samples = make_samples()
    stats = [engine.train_batch(samples, sft_token_loss) for _ in range(STEPS)]
    return stats, engine.forward(samples)


def _worker(model_dir: str, out: str) -> None:
    from asyncrl.train.fsdp import FSDPTrainEngine

    torch.set_num_threads(1)
    engine = FSDPTrainEngine(load_causal_lm(model_dir), CFG)
    stats, logprobs = run_steps(engine)
    state = engine.full_state_dict()
    if engine.rank == 0:
        torch.save({"state": state, "stats": stats, "logprobs": logprobs,
                    "step": engine.step}, out)
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_two_ranks_equal_one_process(tmp_path):
    model_dir = build_tiny_model(TINY, tmp_path / "tiny")
    out = tmp_path / "fsdp.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path.cwd()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), __file__, str(model_dir), str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"torchrun 2 ranks: {time.perf_counter() - t0:.1f}s")
    dist_run = torch.load(out, weights_only=False)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = HFTrainEngine(load_causal_lm(model_dir), CFG)
        stats, logprobs = run_steps(single)
    finally:
        torch.set_num_threads(before)
    assert dist_run["step"] == single.step == STEPS
    for d, s in zip(dist_run["stats"], stats):
        assert abs(d["train/loss"] - s["train/loss"]) < 1e-5
        assert d["train/loss_tokens"] == s["train/loss_tokens"]
        assert abs(d["train/grad_norm"] - s["train/grad_norm"]) < 1e-5
        assert abs(d["sft/nll_per_token"] - s["sft/nll_per_token"]) < 1e-5
    ref = single.model.state_dict()
    assert set(dist_run["state"]) == set(ref)
    for name, value in dist_run["state"].items():
        torch.testing.assert_close(value, ref[name], atol=1e-5, rtol=0, msg=name)
    assert single.share_prefixes and shared_prefix_layout(
        build_micro_batches(make_samples()[:3], 100)[0]) is not None
    for sample, a, b in zip(make_samples(), dist_run["logprobs"], logprobs):
        trained = torch.tensor(sample.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(a[trained], b[trained], atol=1e-5, rtol=0)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
    # Skip interpreter teardown: C++ threads of the torch.distributed stack still being destroyed
    # at exit can abort a finished worker ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
