"""Training throughput and MFU of `HFTrainEngine` vs a plain HF training loop, real-size model.

Both sides train the random-init Qwen2.5-0.5B-shaped preset (`asyncrl build-model`, cached) with
fp32 master weights under bf16 autocast, on the same batch: --samples sequences of random regular
token ids, lengths uniform in [--min-len, --max-len], loss on every token (an SFT step), one
AdamW step (same lr/betas/eps, no weight decay, no clipping) per batch. Ours:
`train_batch(samples, sft_token_loss)` with TrainEngineConfig(autocast_dtype="bfloat16",
max_tokens_per_mb). Baseline: the ordinary transformers loop: chunks of --hf-batch samples in
order, right-padded, `model(input_ids, attention_mask, labels).loss` scaled for accumulation,
backward, `torch.optim.AdamW.step()`.

tokens/s counts real tokens (padding excluded) over one full step; the two run alternately (one
warm-up, then best of --repeats). MFU = 6 * params * tokens/s / --peak-flops (default: H100 SXM
bf16 dense, 989 TFLOP/s; attention score FLOPs not counted); the header also prints the device's
measured bf16 matmul GFLOP/s, and "of matmul" is MFU against that measured number instead.

    python benchmarks/bench_gpu_train.py                                  # cuda, 0.5B
    python benchmarks/bench_gpu_train.py --device cpu --preset tiny --samples 8 --max-len 128
"""
from __future__ import annotations

import argparse
import os

import torch
from bench_train import HFLoop, make_samples  # the tiny-model benchmark's baseline and samples
from gpu_common import (
    count_parameters,
    H100_BF16_DENSE_FLOPS,
    check_device,
    default_device,
    device_name,
    finish,
    matmul_gflops,
    preset_model_dir,
    print_table,
    timed,
)

from asyncrl.api.trajectory import Sample
from asyncrl.models.loading import load_causal_lm
from asyncrl.train.engine import HFTrainEngine, sft_token_loss
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.config import OptimizerConfig

# Throughput does not depend on the lr; a small one keeps many steps of random data finite.
OPTIM = OptimizerConfig(lr=1e-5, grad_clip=None, weight_decay=0.0)
REGULAR_TOKENS = 151_643


def bench(args: argparse.Namespace, path: str, samples: list[Sample]
          ) -> tuple[float, float, float, int]:
    """(HF, ours) best real tokens/s, the positions ours computed per real token, and its
    micro-batch budget."""
    ours = HFTrainEngine(load_causal_lm(path, dtype="float32"), TrainEngineConfig(
        max_tokens_per_mb=args.max_tokens_per_mb, optimizer=OPTIM, device=str(args.device),
        autocast_dtype="bfloat16"))
    hf = HFLoop(load_causal_lm(path, dtype="float32"), args.hf_batch, True, args.device, OPTIM)
    tokens = sum(len(s.input_ids) for s in samples)
    hf_best = ours_best = 0.0
    for rep in range(args.repeats + 1):  # interleaved; rep 0 is the warm-up
        hf_tps = tokens / timed(lambda: hf.step(samples), args.device)
        ours_tps = tokens / timed(lambda: ours.train_batch(samples, sft_token_loss), args.device)
        if rep:
            hf_best, ours_best = max(hf_best, hf_tps), max(ours_best, ours_tps)
    return hf_best, ours_best, ours.positions_computed / tokens, ours.micro_batch_tokens


def hf_padded(samples: list[Sample], batch: int) -> int:
    """Positions the baseline computes: each chunk of `batch` samples padded to its longest."""
    lengths = [len(s.input_ids) for s in samples]
    return sum(len(c) * max(c) for c in (lengths[i:i + batch]
                                          for i in range(0, len(lengths), batch)))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=default_device(), help="cuda, cuda:N or cpu")
    ap.add_argument("--preset", default="qwen2.5-0.5b", help="tiny | qwen2.5-0.5b | qwen2.5-1.5b")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-tokens-per-mb", type=int, default=None,
                    help="ours: packing budget (default: the engine's, sized for the card)")
    ap.add_argument("--hf-batch", type=int, default=8, help="baseline: samples per padded chunk")
    ap.add_argument("--repeats", type=int, default=3, help="best of N (after one warm-up)")
    ap.add_argument("--peak-flops", type=float, default=H100_BF16_DENSE_FLOPS,
                    help="MFU denominator in FLOP/s (default: H100 bf16 dense, 989e12)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--record", default=None, metavar="FILE.json", help="write the summary here")
    args = ap.parse_args()
    args.device = check_device(args.device)
    if not 1 <= args.min_len <= args.max_len:
        ap.error(f"--min-len={args.min_len} --max-len={args.max_len}: need 1 <= min <= max")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = parse_args()
    path = str(preset_model_dir(args.preset, "bfloat16" if args.preset != "tiny" else None))
    probe = load_causal_lm(path, dtype="bfloat16")
    params, vocab = count_parameters(probe), min(probe.config.vocab_size, REGULAR_TOKENS)
    del probe
    samples = make_samples(args.samples, args.min_len, args.max_len, vocab)
    tokens = sum(len(s.input_ids) for s in samples)
    gflops = matmul_gflops(args.device, torch.bfloat16)
    print(f"{args.preset}: {params / 1e6:.1f}M params, fp32 master + bf16 autocast | "
          f"{device_name(args.device)} | bf16 matmul {gflops:,.0f} GFLOP/s | peak "
          f"{args.peak_flops / 1e12:,.0f} TFLOP/s | {len(samples)} samples, len "
          f"U[{args.min_len}, {args.max_len}], {tokens} tokens | HF chunks of {args.hf_batch} "
          f"({hf_padded(samples, args.hf_batch) / tokens:.2f} computed per real token) | "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    hf, ours, computed, budget = bench(args, path, samples)
    print(f"ours: {budget} tokens per micro-batch, {computed:.2f} computed per real token")
    flops_per_token = 6 * params

    def mfu(tps: float) -> float:
        return tps * flops_per_token / args.peak_flops

    def of_matmul(tps: float) -> float:
        return tps * flops_per_token / (gflops * 1e9)

    print_table(["side", "tok/s", "MFU", "of matmul", "ours/HF"], [
        ["HF loop", hf, f"{mfu(hf):.2%}", f"{of_matmul(hf):.1%}", None],
        ["ours", ours, f"{mfu(ours):.2%}", f"{of_matmul(ours):.1%}", ours / hf]])
    finish({"bench": "gpu_train", "device": device_name(args.device), "preset": args.preset,
            "params": params, "tokens_per_step": tokens, "matmul_gflops_bf16": gflops,
            "peak_flops": args.peak_flops, "hf_tok_s": hf, "ours_tok_s": ours,
            "ours_over_hf": ours / hf, "hf_mfu": mfu(hf), "ours_mfu": mfu(ours),
            "ours_tokens_per_mb": budget, "ours_computed_per_real_token": computed,
            "hf_computed_per_real_token": hf_padded(samples, args.hf_batch) / tokens},
           args.record)


if __name__ == "__main__":
    main()
