"""The built-in engine vs transformers `generate` on the embedded tiny VLM, in one run.

The tiny Qwen2-VL (`asyncrl build-model --preset tiny-vl`: 6.6M parameters, 112-px images -> 16
image tokens) and `--batch` rendered counting prompts (one image each, 64 prompt tokens) go
through both; every sequence generates exactly `--new-tokens` tokens (EOS ignored), sampled at
temperature 1. Tokens/s counts generated tokens over wall time including prefill; images/s is
prompts (one image each) over the same time. Both alternate in one process (one warm-up, then
best of --repeats each), so a noisy machine slows both alike: compare the ratio column.

Also timed: the vision tower alone on the batch's images (per prompt), against a whole prompt's
forward (vision tower + language model over the 64 tokens), the share of a prefill the tower is.

The engine serves a VLM on its transformers fallback runner (the compact native model is
text-only), which recomputes every sequence, image included, at every step: this benchmark is
where that cost shows.

    python benchmarks/bench_vlm.py                    # batch 16, 16 new tokens, best of 3
    python benchmarks/bench_vlm.py --json benchmarks/results/bench_vlm.json
"""
from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_preset_model("tiny-vl", tmp)
        encoder = VisionPromptEncoder.from_model_dir(path)
        rows = CountingTaskConfig(num_train=0, num_eval=args.batch).build().eval_rows()
        prompts, images = zip(*(row_prompt(encoder.tokenizer, encoder, r) for r in rows))
        model = policy_model_class(True).from_pretrained(str(path), local_files_only=True).eval()
        engine = LLMEngine(EngineConfig(model_path=str(path), max_num_seqs=args.batch))
        hf = best(lambda: run_hf(model, prompts, list(images), args.new_tokens), args.repeats)
        ours = best(lambda: run_ours(engine, prompts, images, args.new_tokens), args.repeats)
        tower, prefill = tower_costs(model, prompts, list(images), args.repeats)
    tokens = args.batch * args.new_tokens
    result = {
        "machine_threads": torch.get_num_threads(), "batch": args.batch,
        "new_tokens": args.new_tokens, "prompt_tokens": len(prompts[0]),
        "image_tokens": prompts[0].count(encoder.pad_id),
        "hf_tokens_per_s": tokens / hf, "ours_tokens_per_s": tokens / ours,
        "hf_images_per_s": args.batch / hf, "ours_images_per_s": args.batch / ours,
        "ours_over_hf": hf / ours, "runner": type(engine.runner).__name__,
        "vision_tower_ms_per_prompt": tower * 1e3, "prompt_forward_ms_per_prompt": prefill * 1e3,
        "tower_share_of_prompt_forward": tower / prefill,
    }
    print(f"tiny VLM, batch {args.batch}, {len(prompts[0])}-token prompts "
          f"({result['image_tokens']} image tokens), {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"  transformers generate: {tokens / hf:8.1f} tok/s  {args.batch / hf:6.2f} images/s")
    print(f"  asyncrl engine ({result['runner']}): {tokens / ours:8.1f} tok/s  "
          f"{args.batch / ours:6.2f} images/s  ours/HF {hf / ours:.2f}x")
    print(f"  vision tower: {tower * 1e3:.2f} ms per prompt = {tower / prefill:.0%} of a whole "
          f"prompt forward ({prefill * 1e3:.2f} ms per prompt)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
