"""Do the inference engines hold the trainer's weights? A logprob canary after weight updates.

Each engine (every server, or the in-process engine) generates a few tokens from each prompt of a
small fixed canary batch at the training temperature (full
vocabulary: top_p 1, top_k off, so served "processed" logprobs are plain log_softmax(logits/T));
the trainer scores the same tokens with its current weights. A mean absolute difference above the
tolerance stops the run with an error naming the server: a server that serves another model, a
reload that silently failed (vLLM-CPU's stale tied output head), or logprobs computed before the
temperature all show up here, and would otherwise only bias the loss's importance ratios.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncrl.api import GenerationConfig, ModelRequest, ServingEngine
from asyncrl.api.images import ImageInputs
from asyncrl.errors import UserError


class WeightCheckError(UserError):
    """A server's logprobs do not match the trainer's: it does not hold the pushed weights (a
    server set-up the user fixes; the CLI prints the message as one line)."""


# (prompt ids, output ids, the prompt's images or None) -> logprobs
Scorer = Callable[[list[int], list[int], ImageInputs | None], list[float]]


class LogprobCheck:
    def __init__(self, score: Scorer, prompts: list[list[int]], temperature: float,
                 tolerance: float, new_tokens: int = 4,
                 images: Sequence[ImageInputs | None] | None = None) -> None:
        """`images`: each prompt's images (a vision-language model's canary), else None."""
        if not prompts:
            raise ValueError("LogprobCheck needs at least one canary prompt")
        self.score, self.prompts = score, [list(p) for p in prompts]
        self.images = list(images) if images is not None else [None] * len(prompts)
        self.gconfig = GenerationConfig(max_new_tokens=new_tokens, temperature=temperature,
                                        top_p=1.0, top_k=0)
        self.tolerance = tolerance

    async def run(self, engine: ServingEngine, version: int) -> dict[str, float]:
        """Probe every healthy server of `engine` (or the in-process engine); raise
        WeightCheckError if one is off; return the worst engine's mean and max differences."""
        results = []
        for i, (prompt, images) in enumerate(zip(self.prompts, self.images)):
            req = ModelRequest(prompt, self.gconfig, rid=f"logprob-check-v{version}-{i}",
                               images=images)
            results += [(address, resp, images)
                        for address, resp in await engine.generate_on_each(req)]
        if not results:
            raise WeightCheckError(f"no healthy server to probe at weight version {version}")
        worst_mean = worst_max = 0.0
        for address, resp, images in results:
            if not resp.output_tokens:  # EOS first: nothing to compare, and nothing wrong
                continue
            try:
                ours = self.score(list(resp.input_tokens), list(resp.output_tokens), images)
            except (IndexError, RuntimeError) as err:  # e.g. token ids past the trainer's vocab
                raise WeightCheckError(
                    f"{address} at weight version {version}: the trainer cannot score the "
                    f"tokens it generated ({type(err).__name__}: {err}); it serves another "
                    "model") from err
            diffs = [abs(a - b) for a, b in zip(ours, resp.output_logprobs, strict=True)]
            mean, top = sum(diffs) / len(diffs), max(diffs)
            if mean > self.tolerance:
                raise WeightCheckError(
                    f"{address} at weight version {version}: its logprobs differ from the "
                    f"trainer's by {mean:.3g} on average (max {top:.3g}, tolerance "
                    f"{self.tolerance}) over {len(diffs)} probe tokens. It does not compute with "
                    "the trainer's weights and temperature: it serves another model, a weight "
                    "reload failed (vLLM: serve a model with an untied lm_head), or it reports "
                    "logprobs before temperature (vLLM: --logprobs-mode processed_logprobs). "
                    "inference.check_logprobs_tolerance sets the bound")
            worst_mean, worst_max = max(worst_mean, mean), max(worst_max, top)
        return {"weight_check/mean_abs_diff": worst_mean, "weight_check/max_abs_diff": worst_max,
                "weight_check/tokens": float(sum(len(r.output_tokens) for _, r, _ in results))}
