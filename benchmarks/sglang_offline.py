"""SGLang's offline engine (`sglang.Engine`) on the prompts bench_engine.py gives it; run with the
python of the SGLang environment (tests/integration/sglang_venv.py: CPU torch, SGLang's
torch-native attention, stand-ins for its CUDA-only packages), as vllm_offline.py runs vLLM.

    SGLANG_USE_CPU_ENGINE=1 OMP_NUM_THREADS=1 VENV_PYTHON benchmarks/sglang_offline.py SPEC.json

SPEC: {"model", "dtype", "new_tokens", "greedy", "repeats", "prompts": {"<batch>": [[ids]...]}}.
One engine serves every batch size; each size runs one warm-up, then the best of `repeats`.
"""
import json
import sys
import time

import sglang


def main() -> dict[str, float]:  # SGLang spawns its scheduler process: module code is guarded
    spec = json.load(open(sys.argv[1]))
    longest = max(len(p[0]) for p in spec["prompts"].values())
    most = max(len(p) for p in spec["prompts"].values())
    llm = sglang.Engine(model_path=spec["model"], dtype=spec["dtype"],
                        max_running_requests=most,
                        max_total_tokens=max(4096, most * (longest + spec["new_tokens"])),
                        # headroom: SGLang keeps prompt + new tokens strictly below it
                        context_length=longest + spec["new_tokens"] + 8, log_level="error")
    params = {"max_new_tokens": spec["new_tokens"], "ignore_eos": True,
              "temperature": 0.0 if spec["greedy"] else 1.0}
    out = {}
    try:
        for batch, prompts in spec["prompts"].items():
            best = 0.0
            for rep in range(spec["repeats"] + 1):
                t = time.perf_counter()
                results = llm.generate(input_ids=prompts, sampling_params=params)
                elapsed = time.perf_counter() - t
                got = sorted({len(r["output_ids"]) for r in results})
                if got != [spec["new_tokens"]]:
                    raise RuntimeError(f"SGLang generated {got} tokens, not {spec['new_tokens']}")
                best = max(best, len(prompts) * spec["new_tokens"] / elapsed) if rep else 0.0
            out[batch] = best
    finally:
        llm.shutdown()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
