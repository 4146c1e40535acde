"""Memory and step time of LoRA (`train.lora`) vs full fine-tuning, same model, same run.

Both sides are `HFTrainEngine` on the same model directory and the same samples (--samples
sequences, lengths uniform in [16, --max-len], SFT loss on every token), one AdamW step per
train_batch. Each side runs in a fresh child process (spawned one after the other by this
script), so its peak RSS is its own: the model, its gradients, the optimizer state and the
activations of one step. Reported per side:

    trainable    parameters in the optimizer
    optim MB     AdamW state bytes (exp_avg + exp_avg_sq of every trainable parameter)
    grad MB      gradient bytes after a step (only trainable parameters get one)
    peak RSS MB  the child's maximum resident set (ru_maxrss), after loading + --steps steps
    step s       best of --steps timed steps (one warm-up first)

and the ratios LoRA / full. The header prints this machine's fp32 matmul GFLOP/s (the shared
probe of bench_engine.py), so step times can be read across machines; on a CPU LoRA still pays
the forward and the activation gradients through the frozen base, it saves the weight-gradient
matmuls and the optimizer step.

Run from the repository root:

    python benchmarks/bench_lora.py                                   # the 6.4M tiny model
    asyncrl build-model --preset qwen2.5-0.5b /tmp/qwen05             # 494M, random weights
    python benchmarks/bench_lora.py --model /tmp/qwen05 --samples 4 --max-len 64 --steps 2
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import tempfile
import time
from typing import Any

import torch
from gpu_common import matmul_gflops  # the one shared roofline probe (same dir)
from bench_train import make_samples

from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.train.engine import HFTrainEngine, sft_token_loss
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.config import LoraConfig
from asyncrl.train.config import OptimizerConfig

MB = 1 << 20


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def measure(side: str, args: argparse.Namespace, out: Any) -> None:
    """One side in this (child) process; puts its numbers on `out`."""
    torch.set_num_threads(args.threads)
    lora = LoraConfig(r=args.r, alpha=2.0 * args.r) if side == "lora" else None
    cfg = TrainEngineConfig(max_tokens_per_mb=args.max_tokens_per_mb,
                            optimizer=OptimizerConfig(lr=1e-5, grad_clip=None))
    engine = HFTrainEngine.from_pretrained(args.model, cfg, dtype="float32", lora=lora)
    vocab = engine.model.config.vocab_size
    samples = make_samples(args.samples, 16, args.max_len, min(vocab, 30000), seed=0)
    engine.train_batch(samples, sft_token_loss)  # warm-up; allocates Adam's state
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.train_batch(samples, sft_token_loss)
        times.append(time.perf_counter() - t0)
    state = engine.optimizer.state.values()
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    out.put({
        "side": side,
        "params": sum(p.numel() for p in engine.model.parameters()),
        "trainable": sum(p.numel() for p in params),
        "optim": sum(tensor_bytes(s.values()) for s in state),
        "grad": tensor_bytes(p.grad for p in params),
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "step": min(times),
        "tokens": sum(len(s.input_ids) for s in samples),
    })


def run_side(side: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # a fresh interpreter: its peak RSS is this side's alone
    out = ctx.Queue()
    proc = ctx.Process(target=measure, args=(side, args, out))
    proc.start()
    result = out.get()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"{side} side exited with {proc.exitcode}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: build the tiny model)")
    ap.add_argument("--r", type=int, default=8, help="LoRA rank (alpha = 2r)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--max-tokens-per-mb", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        args.model = str(build_tiny_model(TinyModelConfig(), tempfile.mkdtemp() + "/tiny"))
    gflops = matmul_gflops()
    print(f"model {args.model} | {args.samples} samples <= {args.max_len} tokens | "
          f"{args.threads} threads | matmul {gflops:.0f} GFLOP/s fp32")
    full, lora = run_side("full", args), run_side("lora", args)
    print(f"{full['params'] / 1e6:.1f}M parameters, {full['tokens']} tokens per step, "
          f"LoRA r={args.r} on every attention + MLP projection")
    print(f"{'':6} {'trainable':>12} {'optim MB':>10} {'grad MB':>9} {'peak RSS MB':>12} "
          f"{'step s':>8} {'tok/s':>9}")
    for row in (full, lora):
        print(f"{row['side']:6} {row['trainable']:>12,} {row['optim'] / MB:>10.2f} "
              f"{row['grad'] / MB:>9.2f} {row['rss'] / MB:>12.0f} {row['step']:>8.3f} "
              f"{row['tokens'] / row['step']:>9,.0f}")
    ratio = {k: lora[k] / max(full[k], 1) for k in ("trainable", "optim", "grad", "rss", "step")}
    print(f"{'lora/full':>6} {ratio['trainable']:>12.4f} {ratio['optim']:>10.4f} "
          f"{ratio['grad']:>9.4f} {ratio['rss']:>12.3f} {ratio['step']:>8.3f}")


if __name__ == "__main__":
    main()
