"""The built-in engine vs transformers `generate` on the embedded tiny VLM, in one run.

The tiny Qwen2-VL (`asyncrl build-model --preset tiny-vl`: 6.7M parameters, 112-px images -> 16
image tokens) and `--batches` of rendered counting prompts (one image each, 64 prompt tokens) go
through transformers `generate` and the engine on both of its runners: the compact model
(`native`: vision tower once per prompt, M-RoPE, KV cache, C++ decode kernels) and the
transformers fallback (`hf`: recomputes every sequence, image included, at every step). Every
sequence generates exactly `--new-tokens` tokens (EOS ignored), sampled at temperature 1.
Tokens/s counts generated tokens over wall time including prefill; images/s is prompts (one image
each) over the same time. All alternate in one process (one warm-up, then best of --repeats
each), so a noisy machine slows them alike: compare the ratio columns.

Also timed: the vision tower alone on the batch's images (per prompt), against a whole prompt's
forward (vision tower + language model over the 64 tokens), the share of a prefill the tower is.

    python benchmarks/bench_vlm.py                    # batches 1, 16, 64; 16 new tokens; best of 3
    python benchmarks/bench_vlm.py --json benchmarks/results/bench_vlm.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time

import torch

from asyncrl.api import GenerationConfig, ModelRequest
from asyncrl.data.counting import CountingTaskConfig
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.models.export import policy_model_class
from asyncrl.models.presets import build_preset_model
from asyncrl.models.vision import VisionPromptEncoder, row_prompt, vlm_forward_kwargs


def best(fn, repeats: int) -> float:
    fn()  # warm-up
    return min(fn() for _ in range(repeats))


def run_hf(model, prompts, images, new_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(**vlm_forward_kwargs(model, ids, attn.bool(), images),
                             attention_mask=attn, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, top_k=0, top_p=1.0,
                             pad_token_id=0)
        elapsed = time.perf_counter() - t
    assert out.shape[1] == width + new_tokens
    return elapsed


def run_ours(engine: LLMEngine, prompts, images, new_tokens: int) -> float:
    g = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=1.0,
                         top_k=0, top_p=1.0, seed=0)
    reqs = [ModelRequest(p, g, rid=f"r{i}", images=x)
            for i, (p, x) in enumerate(zip(prompts, images))]
    t = time.perf_counter()
    outs = engine.generate(reqs)
    elapsed = time.perf_counter() - t
    assert all(len(o.output_tokens) == new_tokens for o in outs)
    return elapsed


def tower_costs(model, prompts, images, repeats: int) -> tuple[float, float]:
    """(vision tower s per prompt, whole-prompt forward s per prompt) over the batch."""
    pixels = torch.cat([x.pixel_values for x in images])
    grid = torch.cat([x.grid_thw for x in images])
    ids = torch.tensor(prompts)  # same length: one image each
    kwargs = vlm_forward_kwargs(model, ids, torch.ones_like(ids, dtype=torch.bool), images)

    def tower() -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            model.model.get_image_features(pixels, grid)
            return time.perf_counter() - t

    def forward() -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            model(**kwargs, use_cache=False)
            return time.perf_counter() - t

    n = len(prompts)
    return best(tower, repeats) / n, best(forward, repeats) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_preset_model("tiny-vl", tmp)
        encoder = VisionPromptEncoder.from_model_dir(path)
        rows = CountingTaskConfig(num_train=0, num_eval=max(batches)).build().eval_rows()
        all_prompts, all_images = zip(*(row_prompt(encoder.tokenizer, encoder, r) for r in rows))
        model = policy_model_class(True).from_pretrained(str(path), local_files_only=True).eval()
        engines = {b: LLMEngine(EngineConfig(model_path=str(path), max_num_seqs=max(batches),
                                             backend=b)) for b in ("native", "hf")}
        print(f"tiny VLM, {len(all_prompts[0])}-token prompts "
              f"({all_prompts[0].count(encoder.pad_id)} image tokens), {args.new_tokens} new "
              f"tokens, {torch.get_num_threads()} threads, best of {args.repeats}")
        print(f"{'batch':>5} {'HF generate':>12} {'native':>10} {'fallback':>10} "
              f"{'native/HF':>10} {'fallback/HF':>12} {'native img/s':>13}")
        for batch in batches:
            prompts, images = all_prompts[:batch], list(all_images[:batch])
            hf = best(lambda: run_hf(model, prompts, images, args.new_tokens), args.repeats)
            ours = {b: best(lambda e=e: run_ours(e, prompts, images, args.new_tokens),
                            args.repeats) for b, e in engines.items()}
            tokens = batch * args.new_tokens
            rows_out.append({
                "batch": batch, "hf_tokens_per_s": tokens / hf,
                "native_tokens_per_s": tokens / ours["native"],
                "fallback_tokens_per_s": tokens / ours["hf"],
                "native_images_per_s": batch / ours["native"],
                "native_over_hf": hf / ours["native"], "fallback_over_hf": hf / ours["hf"]})
            r = rows_out[-1]
            print(f"{batch:>5} {r['hf_tokens_per_s']:>12.1f} {r['native_tokens_per_s']:>10.1f} "
                  f"{r['fallback_tokens_per_s']:>10.1f} {r['native_over_hf']:>9.2f}x "
                  f"{r['fallback_over_hf']:>11.2f}x {r['native_images_per_s']:>13.1f}")
        n = min(16, max(batches))
        tower, prefill = tower_costs(model, all_prompts[:n], list(all_images[:n]), args.repeats)
    print(f"  (tokens/s; vision tower: {tower * 1e3:.2f} ms per prompt = {tower / prefill:.0%} of "
          f"a whole prompt forward, {prefill * 1e3:.2f} ms per prompt)")
    result = {
        "command": " ".join(["python", "benchmarks/bench_vlm.py", *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "machine_threads": torch.get_num_threads(), "new_tokens": args.new_tokens,
        "prompt_tokens": len(all_prompts[0]),
        "image_tokens": all_prompts[0].count(encoder.pad_id), "by_batch": rows_out,
        "vision_tower_ms_per_prompt": tower * 1e3, "prompt_forward_ms_per_prompt": prefill * 1e3,
        "tower_share_of_prompt_forward": tower / prefill,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
