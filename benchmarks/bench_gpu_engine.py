"""Generation throughput of the built-in engine vs transformers `generate` on a real-size model.

Every side runs the random-init Qwen2.5-0.5B-shaped preset (`asyncrl build-model`, cached) on one
device, on the same random prompts (--prompt-len tokens from the regular vocabulary), and every
sequence generates exactly --new-tokens tokens (EOS ignored; temperature-1 sampling, or --greedy).
Sides, interleaved per batch size (one warm-up, then best of --repeats, so drift hits all alike):

- `graphs`: the engine with CUDA graphs (inference.engine.cuda_graphs, the default on CUDA);
- `eager`: the engine with cuda_graphs off (the same bucketed static shapes, launched op by op);
- `hf`: transformers `generate` with its dynamic cache;
- `hf-compiled`: `generate` with a static cache, which compiles its decoding forward with
  torch.compile (CompileConfig mode reduce-overhead: CUDA graphs), HF's own fast path; its
  compilation is in the warm-up.

Per side: generated tokens/s (prefill included), ms per decode step (wall time / new tokens) and
peak memory. For the engine also the graphs' capture time and, at batch 1, the largest logprob
difference to the trainer's forward (transformers on the prompt + output, same dtype). The header
prints the measured matmul GFLOP/s and HBM bandwidth; "roofline" shares: tokens/s against 2 *
params FLOPs per token (compute) and, at batch 1, against reading every weight once per step
(bandwidth).

    python benchmarks/bench_gpu_engine.py                          # cuda, 0.5B, batch 1/64/256
    python benchmarks/bench_gpu_engine.py --device cpu --preset tiny --batch-sizes 1,16 \\
        --prompt-len 16 --new-tokens 16 --sides eager,hf           # CPU smoke run
"""
from __future__ import annotations

import argparse
import os

import torch
from gpu_common import (
    bandwidth_gbs,
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


SIDES = ("graphs", "eager", "hf", "hf-compiled")


def engine_config(args: argparse.Namespace, path: str, batch: int, graphs: bool) -> EngineConfig:
    return EngineConfig(
        model_path=path, max_num_seqs=batch, max_seq_len=args.prompt_len + args.new_tokens,
        dtype=args.dtype, ignore_eos=True, seed=args.seed,
        max_prefill_tokens=max(8192, batch * args.prompt_len),
        device=str(args.device), cuda_graphs=graphs)


class HFSide:
    """transformers `generate`, sampling or greedy as the engine does; `compiled`: a static
    cache and a torch.compile'd forward (HF's CUDA-graph path)."""

    def __init__(self, model, args: argparse.Namespace, compiled: bool) -> None:
        self.model, self.args, self.compiled = model, args, compiled

    def __call__(self, prompts: torch.Tensor) -> int:
        a = self.args
        kw = {}
        if self.compiled:  # generate compiles its decoding forward itself for a static cache
            from transformers import CompileConfig

            kw = {"cache_implementation": "static",
                  "compile_config": CompileConfig(fullgraph=True, mode="reduce-overhead")}
        with torch.inference_mode():
            out = self.model.generate(
                prompts.to(a.device), attention_mask=torch.ones_like(prompts).to(a.device),
                max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                do_sample=not a.greedy, top_k=0, top_p=1.0, temperature=1.0,
                pad_token_id=0, **kw)
        if out.shape[1] != prompts.shape[1] + a.new_tokens:
            raise RuntimeError(f"HF generated {out.shape[1] - prompts.shape[1]} tokens")
        return prompts.shape[0] * a.new_tokens


class OursSide:
    def __init__(self, args: argparse.Namespace, path: str, batch: int, graphs: bool) -> None:
        self.args = args
        self.engine = LLMEngine(engine_config(args, path, batch, graphs))
        self.outs: list = []

    def __call__(self, prompts: torch.Tensor) -> int:
        gc = GenerationConfig(max_new_tokens=self.args.new_tokens, greedy=self.args.greedy)
        self.outs = self.engine.generate([ModelRequest(p, gc) for p in prompts.tolist()])
        if any(len(o.output_tokens) != self.args.new_tokens for o in self.outs):
            raise RuntimeError("the engine did not generate the fixed number of tokens")
        return len(self.outs) * self.args.new_tokens

    def capture_seconds(self) -> float | None:
        static = getattr(self.engine.runner, "static", None)
        return None if static is None or not static.graphs_on else static.capture_seconds


def trainer_gap(model, outs: list) -> float:
    """Largest |engine logprob - transformers' forward logprob| over the outputs' tokens."""
    gap = 0.0
    with torch.inference_mode():
        for o in outs:
            ids = torch.tensor([o.input_tokens + o.output_tokens], device=model.device)
            logits = model(ids).logits[0, len(o.input_tokens) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(
                1, torch.tensor(o.output_tokens, device=model.device)[:, None])[:, 0]
            got = torch.tensor(o.output_logprobs, device=model.device)
            gap = max(gap, float((got - ref).abs().max()))
    return gap


def peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def bench_batch(args, path: str, model, prompts: torch.Tensor) -> dict[str, dict]:
    """Per side: best tokens/s, ms per step, peak GiB (and capture s, logprob gap)."""
    sides = {}
    for name in args.sides:
        if name in ("graphs", "eager"):
            sides[name] = OursSide(args, path, prompts.shape[0], name == "graphs")
        else:
            sides[name] = HFSide(model, args, name == "hf-compiled")
    best = dict.fromkeys(sides, 0.0)
    memory = {}
    for rep in range(args.repeats + 1):  # rep 0 warms up (and compiles / captures)
        for name, side in sides.items():
            if args.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(args.device)
            tokens = []
            seconds = timed(lambda s=side: tokens.append(s(prompts)), args.device)
            if rep:
                best[name] = max(best[name], tokens[0] / seconds)
                memory[name] = peak_memory(args.device)
    out = {}
    for name, side in sides.items():
        rec = {"tok_s": best[name], "ms_per_step": 1000 * prompts.shape[0] / best[name],
               "peak_gib": memory.get(name)}
        if isinstance(side, OursSide):
            rec["capture_s"] = side.capture_seconds()
            if prompts.shape[0] == 1:
                rec["trainer_logprob_gap"] = trainer_gap(model, side.outs)
        out[name] = rec
    del sides
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


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
    ap.add_argument("--sides", default=None,
                    help=f"comma-separated, of {', '.join(SIDES)} (default: all on cuda; "
                         "eager,hf on cpu)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", default=None, metavar="FILE.json", help="write the summary here")
    args = ap.parse_args()
    args.device = check_device(args.device)
    args.dtype = args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32")
    cuda = args.device.type == "cuda"
    args.sides = (args.sides or (",".join(SIDES) if cuda else "eager,hf")).split(",")
    if unknown := set(args.sides) - set(SIDES):
        ap.error(f"--sides {sorted(unknown)}: allowed {', '.join(SIDES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = parse_args()
    path = str(preset_model_dir(args.preset, args.dtype))
    model = load_causal_lm(path, dtype=args.dtype).to(args.device)
    params = count_parameters(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = min(model.config.vocab_size, REGULAR_TOKENS)
    gflops = matmul_gflops(args.device, getattr(torch, args.dtype))
    roofline = gflops * 1e9 / (2 * params)  # tokens/s if decode were matmul-bound at 2N FLOPs
    gbs = bandwidth_gbs(args.device, 1.0 if args.device.type == "cuda" else 0.25)
    bw_roofline = gbs * 1e9 / weight_bytes  # batch-1 steps/s if each read the weights once
    print(f"{args.preset}: {params / 1e6:.1f}M params, {args.dtype} | {device_name(args.device)}"
          f" | {args.dtype} matmul {gflops:,.0f} GFLOP/s -> roofline {roofline:,.0f} tok/s | "
          f"copy {gbs:,.0f} GB/s -> batch-1 roofline {bw_roofline:,.0f} tok/s | "
          f"prompt {args.prompt_len} + {args.new_tokens} new | "
          f"{'greedy' if args.greedy else 'sampling T=1'} | load {os.getloadavg()[0]:.2f}",
          flush=True)
    g = torch.Generator().manual_seed(args.seed)
    rows, records = [], []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=g)
        res = bench_batch(args, path, model, prompts)
        base = {k: res[k]["tok_s"] for k in ("hf", "hf-compiled") if k in res}
        for name, r in res.items():
            ratios = {f"over_{k}": r["tok_s"] / v for k, v in base.items() if v}
            share = r["tok_s"] / (bw_roofline if batch == 1 else roofline)
            rows.append([batch, name, f"{r['tok_s']:,.0f}", f"{r['ms_per_step']:.2f}",
                         *(f"{ratios[f'over_{k}']:.2f}" if f"over_{k}" in ratios else "-"
                           for k in ("hf", "hf-compiled")),
                         f"{share:.1%}", "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}",
                         "-" if r.get("capture_s") is None else f"{r['capture_s']:.1f}",
                         "-" if "trainer_logprob_gap" not in r
                         else f"{r['trainer_logprob_gap']:.1e}"])
            records.append({"batch": batch, "side": name, **r, **ratios,
                            "roofline_share": share})
        print(f"batch {batch} done", flush=True)
    print_table(["batch", "side", "tok/s", "ms/step", "/hf", "/hf-comp",
                 "roofline", "peak GiB", "capture s", "lp gap"], rows)
    finish({"bench": "gpu_engine", "device": device_name(args.device), "preset": args.preset,
            "params": params, "dtype": args.dtype, "matmul_gflops": gflops,
            "copy_gbs": gbs, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "greedy": args.greedy, "rows": records,
            "roofline_note": "batch 1: share of the weight-bandwidth bound; others: of 2N FLOPs"},
           args.record)


if __name__ == "__main__":
    main()
