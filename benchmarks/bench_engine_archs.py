"""Generated tokens/s per architecture: the engine's own decoder, its transformers fallback, and
transformers `generate`, in one run.

Each architecture the built-in engine serves natively (Qwen2, Qwen3, Llama 3.x with its RoPE
scaling, Gemma 3 with sliding-window and global layers, Mistral with a sliding window, and the
mixture-of-experts Qwen3-MoE and Mixtral with 4 experts of MLP 384, top 2) is built at the tiny
default's shape (hidden 256, 8 layers, 4 query / 2 KV heads of 64 dims, MLP 768, vocabulary 320,
fp32, seeded random weights) from transformers' own config class. The same random
32-token prompts go through three sides, each generating exactly --new-tokens per sequence
(EOS ignored, T = 1 sampling): `native` (inference.engine.backend native: the compact decoder and
its KV cache), `fallback` (backend hf: what an architecture the decoder does not implement gets,
the transformers model re-run over every whole sequence each step) and `HF generate` (transformers'
own loop with its KV cache). Tokens/s counts generated tokens over wall time including prefill;
the sides alternate (one warm-up, then best of --repeats), so a noisy machine slows all alike:
compare the ratio columns across machines. The header prints the machine's fp32 matmul GFLOP/s.

    python benchmarks/bench_engine_archs.py --json benchmarks/results/bench_engine_archs.json
    python benchmarks/bench_engine_archs.py --archs gemma3 --batch-sizes 64 --repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table

from bench_engine import run_hf, run_ours  # benchmarks/ is on sys.path when run
from gpu_common import matmul_gflops

from asyncrl.inference.engine import EngineConfig, LLMEngine

SHAPE = dict(vocab_size=320, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=768, max_position_embeddings=1024,
             tie_word_embeddings=True)
ARCHS = {
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=64),
    "llama3": lambda: transformers.LlamaConfig(**SHAPE, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256, "rope_theta": 500000.0}),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SHAPE, head_dim=64, query_pre_attn_scalar=64, sliding_window=32, sliding_window_pattern=2),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, head_dim=64, sliding_window=32),
    # 4 experts of MLP 384, top 2: the dense models' active MLP width
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE, head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=384),
    "mixtral": lambda: transformers.MixtralConfig(
        **{**SHAPE, "intermediate_size": 384}, head_dim=64, num_local_experts=4,
        num_experts_per_tok=2),
}


def build(arch: str, path: Path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(ARCHS[arch]()).eval()
    model.save_pretrained(path)
    return model


def best(fn, repeats: int) -> float:
    fn()  # warm-up: kernels built, caches allocated
    return max(fn() for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default=",".join(ARCHS), help="comma-separated: " + ", ".join(ARCHS))
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    gflops = matmul_gflops(torch.device("cpu"), torch.float32)
    console = Console()
    console.print(f"fp32 matmul {gflops:,.0f} GFLOP/s ({args.threads} threads) | prompt "
                  f"{args.prompt_len} + {args.new_tokens} new | T=1 | best of {args.repeats}")
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(5, 101, (b, args.prompt_len), generator=g) for b in batches}
    rows = []
    table = Table("arch", "batch", "native tok/s", "fallback tok/s", "HF generate tok/s",
                  "native/fallback", "native/HF")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            path = Path(tmp) / arch
            model = build(arch, path)
            engines = {side: LLMEngine(EngineConfig(
                model_path=str(path), backend=side, device="cpu", max_num_seqs=max(batches),
                max_seq_len=args.prompt_len + args.new_tokens, ignore_eos=True,
                num_threads=args.threads)) for side in ("native", "hf")}
            for b in batches:
                p = prompts[b]
                native = best(lambda: run_ours(engines["native"], p, args.new_tokens, False),
                              args.repeats)
                fallback = best(lambda: run_ours(engines["hf"], p, args.new_tokens, False),
                                args.repeats)
                hf = best(lambda: run_hf(model, p, args.new_tokens, False), args.repeats)
                rows.append({"arch": arch, "batch": b, "native_tok_s": native,
                             "fallback_tok_s": fallback, "hf_generate_tok_s": hf,
                             "native_over_fallback": native / fallback,
                             "native_over_hf": native / hf})
                table.add_row(arch, str(b), f"{native:,.0f}", f"{fallback:,.0f}", f"{hf:,.0f}",
                              f"{native / fallback:.1f}x", f"{native / hf:.1f}x")
                console.print(f"{arch} batch {b}: native {native:,.0f}, fallback "
                              f"{fallback:,.0f}, HF {hf:,.0f} tok/s")
    console.print(table)
    if args.json:
        record = {"bench": "engine_archs", "command": "python benchmarks/bench_engine_archs.py "
                  + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                             if v is not None and k != "json") + f" --json {args.json}",
                  "date": time.strftime("%Y-%m-%d"), "matmul_gflops_fp32": gflops,
                  "threads": args.threads, "torch": torch.__version__,
                  "transformers": transformers.__version__, "cpus": os.cpu_count(), "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
