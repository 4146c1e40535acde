"""Generation throughput of the built-in engine vs transformers `generate` on a real-size model.

Both run the random-init Qwen2.5-0.5B-shaped preset (`asyncrl build-model`, cached) on one
device, on the same random prompts (--prompt-len tokens from the regular vocabulary), and every
sequence generates exactly --new-tokens tokens (EOS ignored; temperature-1 sampling, or --greedy).
tokens/s = generated tokens / wall time, prefill included. Each batch size runs HF and ours
alternately (one warm-up, then best of --repeats), so drift hits both alike: compare the ours/HF
column across machines. The header prints the device's measured matmul GFLOP/s in the run's
dtype; "roofline" is the share of it that 2 * params FLOPs per generated token would use.

    python benchmarks/bench_gpu_engine.py                          # cuda, 0.5B, batch 1/64/256
    python benchmarks/bench_gpu_engine.py --device cpu --preset tiny --batch-sizes 1,16 \\
        --prompt-len 16 --new-tokens 16                            # CPU smoke run
"""
from __future__ import annotations

import argparse
import os

import torch
from gpu_common import (
    count_parameters,
    check_device,
    default_device,
    device_name,
    finish,
    matmul_gflops,
    preset_model_dir,
    print_table,
    timed,
)

from asyncrl.api import GenerationConfig, ModelRequest
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.models.loading import load_causal_lm

REGULAR_TOKENS = 151_643  # ids below Qwen's added tokens


def engine_config(args: argparse.Namespace, path: str, batch: int) -> EngineConfig:
    return EngineConfig(
        model_path=path, max_num_seqs=batch, max_seq_len=args.prompt_len + args.new_tokens,
        dtype=args.dtype, ignore_eos=True, seed=args.seed,
        max_prefill_tokens=max(8192, batch * args.prompt_len),
        device=str(args.device))


def run_hf(model, prompts: torch.Tensor, args: argparse.Namespace) -> float:
    """Generated tokens/s of HF `generate`, sampling or greedy as the engine does."""
    out = []

    def go():
        with torch.inference_mode():
            out.append(model.generate(
                prompts, attention_mask=torch.ones_like(prompts),
                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                do_sample=not args.greedy, top_k=0, top_p=1.0, temperature=1.0,
                pad_token_id=0))
    seconds = timed(go, args.device)
    if out[0].shape[1] != prompts.shape[1] + args.new_tokens:
        raise RuntimeError(f"HF generated {out[0].shape[1] - prompts.shape[1]} tokens")
    return prompts.shape[0] * args.new_tokens / seconds


def run_ours(engine: LLMEngine, prompts: torch.Tensor, args: argparse.Namespace) -> float:
    gc = GenerationConfig(max_new_tokens=args.new_tokens, greedy=args.greedy)
    reqs = [ModelRequest(p, gc) for p in prompts.tolist()]
    outs = []
    seconds = timed(lambda: outs.extend(engine.generate(reqs)), args.device)
    if any(len(o.output_tokens) != args.new_tokens for o in outs):
        raise RuntimeError("the engine did not generate the fixed number of tokens")
    return len(reqs) * args.new_tokens / seconds


def bench_batch(args, path: str, model, prompts: torch.Tensor) -> tuple[float | None, float]:
    """(HF, ours) best tokens/s for one batch; HF is None with --skip-hf."""
    engine = LLMEngine(engine_config(args, path, prompts.shape[0]))
    hf_best, ours_best = 0.0, 0.0
    for rep in range(args.repeats + 1):  # rep 0 warms up both
        if not args.skip_hf:
            hf = run_hf(model, prompts.to(args.device), args)
            hf_best = max(hf_best, hf) if rep else 0.0
        ours = run_ours(engine, prompts, args)
        ours_best = max(ours_best, ours) if rep else 0.0
    del engine
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    return (None if args.skip_hf else hf_best), ours_best


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=default_device(), help="cuda, cuda:N or cpu")
    ap.add_argument("--preset", default="qwen2.5-0.5b", help="tiny | qwen2.5-0.5b | qwen2.5-1.5b")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--batch-sizes", default="1,64,256", help="comma-separated")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="best of N (after one warm-up)")
    ap.add_argument("--greedy", action="store_true", help="greedy, not temperature-1 sampling")
    ap.add_argument("--skip-hf", action="store_true", help="ours only")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", default=None, metavar="FILE.json", help="write the summary here")
    args = ap.parse_args()
    args.device = check_device(args.device)
    args.dtype = args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = parse_args()
    path = str(preset_model_dir(args.preset, args.dtype))
    model = load_causal_lm(path, dtype=args.dtype).to(args.device)
    params = count_parameters(model)
    vocab = min(model.config.vocab_size, REGULAR_TOKENS)
    gflops = matmul_gflops(args.device, getattr(torch, args.dtype))
    roofline = gflops * 1e9 / (2 * params)  # tokens/s if decode were matmul-bound at 2N FLOPs
    print(f"{args.preset}: {params / 1e6:.1f}M params, {args.dtype} | {device_name(args.device)}"
          f" | {args.dtype} matmul {gflops:,.0f} GFLOP/s -> roofline {roofline:,.0f} tok/s | "
          f"prompt {args.prompt_len} + {args.new_tokens} new | "
          f"{'greedy' if args.greedy else 'sampling T=1'} | load {os.getloadavg()[0]:.2f}")
    g = torch.Generator().manual_seed(args.seed)
    rows, records = [], []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=g)
        hf, ours = bench_batch(args, path, model, prompts)
        ratio = ours / hf if hf else None
        rows.append([batch, hf, ours, ratio, f"{ours / roofline:.1%}"])
        records.append({"batch": batch, "hf_tok_s": hf, "ours_tok_s": ours,
                        "ours_over_hf": ratio, "ours_roofline_share": ours / roofline})
    print_table(["batch", "HF tok/s", "ours tok/s", "ours/HF", "roofline"], rows)
    finish({"bench": "gpu_engine", "device": device_name(args.device), "preset": args.preset,
            "params": params, "dtype": args.dtype, "matmul_gflops": gflops,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "greedy": args.greedy, "rows": records}, args.record)


if __name__ == "__main__":
    main()
