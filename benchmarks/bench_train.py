"""Training throughput of `HFTrainEngine` (packed, micro-batched) vs a plain padded HF loop.

Both sides train the same 6.4M-parameter tiny Qwen2 (`TinyModelConfig()` defaults, built into a
temp dir, two identical copies) on the same variable-length samples (default 64, lengths uniform
in [16, --max-len]); one step = all samples, one AdamW step. The baseline is the ordinary
transformers loop: samples in their given order, chunks of --hf-batch right-padded to the chunk's
longest, `model(input_ids, attention_mask, labels).loss` scaled for gradient accumulation,
backward, AdamW step. Ours: `train_batch(samples, sft_token_loss)` with --max-tokens-per-mb.

tokens/s counts REAL tokens (padding excluded) over wall time of one full step. Both sides run
alternately in one process (one warm-up, then best of --repeats), so a noisy machine slows both
alike: compare the ours/HF column across machines, not raw tokens/s. The roofline column is the
share of the machine's fp32 matmul GFLOP/s (measured at start, in the header) at 6 * params FLOPs
per token for forward + backward (attention score FLOPs are not counted); bf16 rows use the same
fp32 reference.

--task grpo trains a batch shaped like the main job's instead: 16 chat prompts of 2-digit
addition (~25 tokens) x 8 completions of 3-8 tokens, loss on the completions only. --layouts
picks ours' micro-batch layouts (`attention_layout`, and `shared` = padded + share_prefixes: each
prompt computed once per group); tokens/s still counts every real token of every sample.

Run from the repository root:

    python benchmarks/bench_train.py                                   # fp32
    python benchmarks/bench_train.py --dtype float32,bfloat16 --repeats 3
    python benchmarks/bench_train.py --samples 32 --max-len 512
    python benchmarks/bench_train.py --task grpo --layouts auto,packed,padded,shared
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence

import torch
from gpu_common import count_parameters, matmul_gflops  # same dir as this script

from asyncrl.api.trajectory import Sample
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.train.engine import HFTrainEngine, sft_token_loss
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.optim import build_optimizer
from asyncrl.train.config import OptimizerConfig

# Tiny lr: both models take many steps over the run and must stay finite; throughput does not
# depend on the value. No grad clip on either side, so the two do identical optimizer work.
OPTIM = OptimizerConfig(lr=1e-5, grad_clip=None)


def make_samples(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[Sample]:
    """Whole sequences trained on (loss on every token but the first, as an SFT step)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        out.append(Sample(input_ids=ids, loss_mask=[1] * length, logprobs=[0.0] * length,
                          versions=[0] * length))
    return out


def make_grpo_samples(groups: int = 16, per_group: int = 8, seed: int = 0) -> list[Sample]:
    """The main job's batch shape: chat prompts of the arithmetic task, short completions."""
    from asyncrl.data.arithmetic import ArithmeticTaskConfig
    from asyncrl.models.chat import encode_chat_prompt
    from asyncrl.models.loading import ensure_tiny_model, load_tokenizer

    tokenizer = load_tokenizer(ensure_tiny_model(TinyModelConfig()))
    rng = random.Random(seed)
    out = []
    for row in ArithmeticTaskConfig(digits=2).build().train_rows()[:groups]:
        prompt = encode_chat_prompt(tokenizer, row["messages"])
        for _ in range(per_group):
            n = rng.randint(3, 8)
            out.append(Sample.from_prompt_and_completion(
                prompt, [rng.randrange(3, 100) for _ in range(n)], [-1.0] * n, [0] * n))
    return out


LAYOUTS = {"auto": {"attention_layout": "auto"},
           "packed": {"attention_layout": "packed"},
           "padded": {"attention_layout": "padded", "share_prefixes": False},
           "shared": {"attention_layout": "padded", "share_prefixes": True}}


class HFLoop:
    """The baseline: padded batches, HF's own label-shifted loss, gradient accumulation."""

    def __init__(self, model: torch.nn.Module, batch: int, autocast: bool,
                 device: torch.device | None = None, optim: OptimizerConfig = OPTIM) -> None:
        self.device = device or torch.device("cpu")
        self.model, self.batch, self.autocast = model.to(self.device), batch, autocast
        self.optimizer, _ = build_optimizer(self.model.parameters(), optim, total_steps=1)

    def _chunk(self, samples: Sequence[Sample]) -> tuple[torch.Tensor, ...]:
        width = max(len(s.input_ids) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, s in enumerate(samples):
            ids[i, :len(s.input_ids)] = torch.tensor(s.input_ids)
            attn[i, :len(s.input_ids)] = 1
        return tuple(t.to(self.device) for t in (ids, attn, ids.masked_fill(attn == 0, -100)))

    def step(self, samples: Sequence[Sample]) -> None:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        chunks = [samples[i:i + self.batch] for i in range(0, len(samples), self.batch)]
        for chunk in chunks:
            ids, attn, labels = self._chunk(chunk)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                loss = self.model(input_ids=ids, attention_mask=attn, labels=labels,
                                  use_cache=False).loss
            (loss / len(chunks)).backward()
        self.optimizer.step()


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_dtype(args: argparse.Namespace, path: str, samples: list[Sample]
                ) -> tuple[float, dict[str, float], dict[str, float]]:
    """HF's and each layout's best real tokens/s for one dtype setting, and the positions each
    layout computes per real token."""
    bf16 = args.current_dtype == "bfloat16"
    engines = {name: HFTrainEngine(load_causal_lm(path), TrainEngineConfig(
        max_tokens_per_mb=args.max_tokens_per_mb, optimizer=OPTIM, device="cpu",
        autocast_dtype="bfloat16" if bf16 else "none", **LAYOUTS[name],
    )) for name in args.layouts}
    hf = HFLoop(load_causal_lm(path), args.hf_batch, bf16)
    tokens = sum(len(s.input_ids) for s in samples)
    hf_best, ours_best = 0.0, dict.fromkeys(engines, 0.0)
    for rep in range(args.repeats + 1):  # interleaved; rep 0 is the warm-up
        hf_tps = tokens / timed(lambda: hf.step(samples))
        for name, engine in engines.items():
            tps = tokens / timed(lambda e=engine: e.train_batch(samples, sft_token_loss))
            if rep:
                ours_best[name] = max(ours_best[name], tps)
        if rep:
            hf_best = max(hf_best, hf_tps)
    # positions each layout computed in its last step (padding included) per real token
    computed = {name: e.positions_computed / tokens for name, e in engines.items()}
    return hf_best, ours_best, computed


def padding_share(samples: Sequence[Sample], batch: int) -> float:
    padded = sum(len(samples[i:i + batch]) * max(len(s.input_ids) for s in samples[i:i + batch])
                 for i in range(0, len(samples), batch))
    return 1.0 - sum(len(s.input_ids) for s in samples) / padded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="best of N (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens-per-mb", type=int, default=1024, help="ours: packing budget")
    ap.add_argument("--hf-batch", type=int, default=16, help="baseline: samples per padded batch")
    ap.add_argument("--dtype", default="float32",
                    help="comma-separated from float32, bfloat16 (bf16 = autocast, fp32 master)")
    ap.add_argument("--task", choices=["random", "grpo"], default="random")
    ap.add_argument("--layouts", default="auto",
                    help=f"ours, comma-separated from {', '.join(LAYOUTS)}")
    args = ap.parse_args()
    args.layouts = args.layouts.split(",")
    if unknown := set(args.layouts) - set(LAYOUTS):
        ap.error(f"--layouts {sorted(unknown)}: allowed {', '.join(LAYOUTS)}")
    dtypes = args.dtype.split(",")
    if unknown := set(dtypes) - {"float32", "bfloat16"}:
        ap.error(f"--dtype {sorted(unknown)}: allowed float32, bfloat16")
    if not 1 <= args.min_len <= args.max_len:
        ap.error(f"--min-len={args.min_len} --max-len={args.max_len}: need 1 <= min <= max")
    torch.set_num_threads(args.threads)

    path = str(build_tiny_model(TinyModelConfig(), tempfile.mkdtemp(prefix="bench_train_")))
    model = load_causal_lm(path)
    params, vocab = count_parameters(model), model.config.vocab_size
    samples = (make_grpo_samples() if args.task == "grpo"
               else make_samples(args.samples, args.min_len, args.max_len, min(vocab, 101)))
    tokens = sum(len(s.input_ids) for s in samples)
    gflops = matmul_gflops()
    roofline = gflops * 1e9 / (6 * params)
    shape = ("main-job batch: 16 prompts x 8 completions" if args.task == "grpo" else
             f"len U[{args.min_len}, {args.max_len}]")
    print(f"model: {params / 1e6:.2f}M params | threads {args.threads} | {len(samples)} samples, "
          f"{shape}, {tokens} real tokens | HF batch "
          f"{args.hf_batch} ({padding_share(samples, args.hf_batch):.0%} padding) | ours budget "
          f"{args.max_tokens_per_mb} tok/mb | fp32 matmul {gflops:.0f} GFLOP/s -> roofline "
          f"{roofline:,.0f} tok/s | load {os.getloadavg()[0]:.2f}")
    print(f"{'dtype':>9} {'layout':>7} {'HF tok/s':>10} {'ours tok/s':>11} {'ours/HF':>8} "
          f"{'HF roof':>8} {'ours roof':>10} {'computed/real':>14}")
    for dtype in dtypes:
        args.current_dtype = dtype
        hf, ours, computed = bench_dtype(args, path, samples)
        for name, tps in ours.items():
            print(f"{dtype:>9} {name:>7} {hf:10,.0f} {tps:11,.0f} {tps / hf:8.2f} "
                  f"{hf / roofline:8.1%} {tps / roofline:10.1%} {computed[name]:14.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
