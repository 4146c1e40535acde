"""The SFT warm-start job: tiny model + synthetic task -> a cached checkpoint with known accuracy.

The result is cached under a key derived from the resolved config, so the RL job (and repeated
`asyncrl sft` calls) reuse it instead of training again. Writes go to a temporary directory that is
renamed into place only when complete. The steps run on the train engine (train/sft.py): one
process, or every rank of a torchrun group with the model sharded by FSDP2 (rank 0 evaluates,
writes the model and reports; every rank returns its result).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from asyncrl.launch.sft_config import SFTRunConfig
from asyncrl.launch.trainer_group import parallelism
from asyncrl.models.loading import (
    TINY_BUILD_VERSION,
    cache_root,
    load_causal_lm,
    load_tokenizer,
    resolve_model_dir,
)
from asyncrl.models.export import save_model_dir
from asyncrl.models.vision import VisionPromptEncoder, row_prompt, vision_encoder
from asyncrl.reward.exact import exact_answer_reward
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.hf_generate import hf_greedy_generate
from asyncrl.train.sft import build_examples, train_sft, with_label_noise
from asyncrl.train.sft_conversation import first_turn

RESULT_FILE = "sft_result.json"


@dataclass
class SFTResult:
    model_dir: str
    eval_accuracy: float
    eval_size: int
    train_seconds: float
    steps: int
    final_loss: float
    cached: bool = False
    # [step, loss] every LOSS_CURVE_EVERY steps: what a rerun of the recipe is compared with
    # (tests/test_shipped_warm_start.py)
    loss_curve: list[list[float]] = field(default_factory=list)
    # torch threads per rank: the order of the float sums, which the result depends on
    threads: int | None = None


# Part of the cache key: bump when the SFT code changes what a config trains (the README's
# main-job figures come from a warm start of this recipe; tests/test_main_job_record.py checks).
# v2: every core (v1 ran on one thread inside `asyncrl train`; the sums differ in order).
# v3: steps on the train engine (padded micro-batches; the sums differ in order).
SFT_RECIPE_VERSION = 3


# Settings that change how fast a warm start trains, not what: left out of the cache key.
SPEED_ONLY = {"train": {"logprob_chunk_tokens"}}


def cache_key(cfg: SFTRunConfig) -> str:
    data = cfg.model_copy(update={"output_dir": None}).model_dump(
        mode="json", exclude={**SPEED_ONLY, "base": True})
    payload = yaml.safe_dump(data, sort_keys=False)  # Config.to_yaml's format
    if cfg.base is not None:  # the warm start continued, by its own key
        payload += f"\nbase: {cache_key(cfg.base)}\n"
    payload += f"\nsft_recipe_version: {SFT_RECIPE_VERSION}\n"
    if cfg.model.path is None:
        # The result embeds the built tiny model's tokenizer (chat template included): a new
        # builder version must not reuse a warm start saved with the old one.
        payload += f"\ntiny_build_version: {TINY_BUILD_VERSION}\n"
    # A regenerated data file must not hit the warm start trained on its old contents.
    for name in ("path", "eval_path"):
        data_file = getattr(cfg.data, name, None)
        if data_file and Path(data_file).is_file():
            digest = hashlib.sha256(Path(data_file).read_bytes()).hexdigest()
            payload += f"\n{name}_sha256: {digest}"
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def output_dir_for(cfg: SFTRunConfig) -> Path:
    return (Path(cfg.output_dir) if cfg.output_dir
            else cache_root() / "sft" / f"tiny-sft-{cache_key(cfg)}")


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int,
                    template_kwargs: dict | None = None,
                    vision: VisionPromptEncoder | None = None) -> float:
    """Mean greedy score: exact final answer for `messages` rows (with their images through
    `vision`, a vision-language model's encoder); for `conversation` rows, whether the first
    assistant turn (EOS included) equals the demonstration's (for a tool agent: the right tool
    call), which is why such eval rows should be clean demonstrations."""
    prompts, targets, images = [], [], []
    for r in rows:
        conv = r.get("conversation") is not None
        if conv:
            (ids, target), pictures = first_turn(tokenizer, r, template_kwargs), None
        else:
            (ids, pictures), target = row_prompt(tokenizer, vision, r, template_kwargs), None
        prompts.append(ids)
        targets.append(target)
        images.append(pictures)
    outs = hf_greedy_generate(model, prompts, max_new_tokens, tokenizer.pad_token_id,
                              tokenizer.eos_token_id, images=images if vision else None)
    plain = tokenizer.batch_decode(outs, skip_special_tokens=True)
    raw = tokenizer.batch_decode(outs, skip_special_tokens=False)
    scores = [float(text == target) if target is not None else exact_answer_reward(p, r["answer"])
              for p, text, target, r in zip(plain, raw, targets, rows)]
    return sum(scores) / len(rows)


def load_cached(out: Path) -> SFTResult | None:
    result = out / RESULT_FILE
    if not result.is_file():
        return None
    return SFTResult(**{**json.loads(result.read_text()), "cached": True, "model_dir": str(out)})


# Warm starts that ship with the package, by cache key (asyncrl/warm_starts/README.md): the main
# job's, so that a fresh install starts training at once with the model every record came from.
SHIPPED_ROOT = Path(__file__).resolve().parent.parent / "warm_starts"


def shipped_dir(cfg: SFTRunConfig) -> Path | None:
    """The package's copy of this config's warm start, if one ships (never for an explicit
    `output_dir`: that asks for a model trained there)."""
    if cfg.output_dir:
        return None
    out = SHIPPED_ROOT / f"tiny-sft-{cache_key(cfg)}"
    return out if (out / RESULT_FILE).is_file() else None


def load_ready(cfg: SFTRunConfig) -> SFTResult | None:
    """The warm start of `cfg` without training: the cached one, else the shipped one."""
    shipped = shipped_dir(cfg)
    return load_cached(output_dir_for(cfg)) or (load_cached(shipped) if shipped else None)


ESTIMATE_AFTER = 5  # steps timed before the SFT estimate is printed
LOSS_CURVE_EVERY = 10  # the result keeps the loss of every 10th step


def estimate_message(step: int, elapsed: float, steps: int,
                     then: tuple[str, float | None] | None) -> str:
    """'SFT: about N min (...)' from the first steps, and the total when a job follows."""
    sft = elapsed / step * steps
    msg = (f"SFT estimate: {sft / 60:.1f} min for {steps} steps ({elapsed / step:.2f} s/step "
           f"over the first {step}, {torch.get_num_threads()} threads)")
    if then is not None:
        what, seconds = then
        total = f"about {(sft + seconds) / 60:.0f} min" if seconds is not None else "then"
        msg += f"; {total} in all with {what}"
    return msg


def run_sft_job(cfg: SFTRunConfig, console: Console | None = None, force: bool = False,
                then: tuple[str, float | None] | None = None) -> SFTResult:
    """Train (or reuse the cached) warm start; under torchrun every rank calls it. `then`: (what
    runs after, its seconds or None), for the total-time estimate printed once the first steps
    are timed."""
    console = console or Console(stderr=True)
    parallel = parallelism(cfg.train.device)
    lead = parallel.rank == 0
    out = output_dir_for(cfg)
    cached = parallel.broadcast_object(None if force or not lead else load_ready(cfg))
    if cached is not None:
        if lead:
            where = "cached" if Path(cached.model_dir) == out else "shipped"
            console.print(f"[green]{where}[/] SFT warm start at {cached.model_dir} "
                          f"(eval accuracy {cached.eval_accuracy:.1%}; `asyncrl sft CONFIG "
                          f"--force` trains it again)")
        return cached
    if lead:
        console.print(f"No cached SFT warm start for this config: training it now "
                      f"({cfg.sft.steps} steps; cached in {out} for later runs). An estimate "
                      f"follows after {ESTIMATE_AFTER} steps.")
    torch.manual_seed(cfg.sft.seed)
    base = (Path(run_sft_job(cfg.base, console).model_dir) if cfg.base is not None
            else resolve_model_dir(cfg.model, cfg.tiny))  # a hub id: its cached snapshot
    tokenizer = load_tokenizer(base, cfg.model.trust_remote_code)
    vision = vision_encoder(base, cfg.model.trust_remote_code)

    def load_base() -> torch.nn.Module:
        return load_causal_lm(base, cfg.model.dtype, cfg.model.trust_remote_code)

    engine = HFTrainEngine(load_base(), cfg.train, total_steps=cfg.sft.steps, parallel=parallel)
    dataset = cfg.data.build()
    train_rows = with_label_noise(dataset.train_rows(), cfg.sft.label_noise,
                                  cfg.sft.label_noise_offset, cfg.sft.seed)
    examples = build_examples(tokenizer, train_rows, cfg.model.template_kwargs(), vision)
    eval_rows = dataset.eval_rows()[: cfg.sft.eval_size]
    params = sum(p.numel() for p in engine.model.parameters())  # a DTensor's is its global
    if lead:
        console.print(f"SFT: {len(examples)} train rows, {len(eval_rows)} eval rows, "
                      f"{params / 1e6:.2f}M params, base {base}, {parallel.world_size} rank(s)")

    def trained_model() -> torch.nn.Module | None:
        """The model as a plain HF module on rank 0 (None elsewhere): the engine's own on one
        process, a copy with the gathered weights under FSDP2 (every rank calls)."""
        if parallel.world_size == 1:
            return engine.model
        weights = engine.model_state_dict()
        if not lead:
            return None
        model = load_base()
        model.load_state_dict(weights)
        return model

    def evaluate() -> tuple[float, torch.nn.Module | None]:
        model = trained_model()
        if model is None:
            return 0.0, None
        return greedy_accuracy(model.eval(), tokenizer, eval_rows, cfg.sft.eval_max_new_tokens,
                               cfg.model.template_kwargs(), vision), model

    history = train_with_progress(engine, examples, cfg, evaluate, console, lead, then)
    train_seconds = history[-1]["time/elapsed_s"]
    accuracy, model = evaluate()
    curve = [[step, round(h["train/loss"], 6)] for step, h in enumerate(history, 1)
             if step % LOSS_CURVE_EVERY == 0]
    result = SFTResult(str(out), accuracy, len(eval_rows), train_seconds, cfg.sft.steps,
                       history[-1]["train/loss"], loss_curve=curve,
                       threads=torch.get_num_threads())
    if lead:
        save_atomically(model, tokenizer, cfg, result, out, base)
        console.print(f"SFT done in {train_seconds:.1f}s: eval greedy accuracy {accuracy:.1%} "
                      f"on {len(eval_rows)} held-out problems -> {out}")
    parallel.barrier()  # the model is in place before any rank uses it
    return parallel.broadcast_object(result)


def train_with_progress(engine: HFTrainEngine, examples: list, cfg: SFTRunConfig,
                        evaluate: Callable[[], tuple[float, object]], console: Console, lead: bool,
                        then: tuple[str, float | None] | None) -> list[dict[str, float]]:
    """`train_sft` under rank 0's progress bar, with the estimate, log lines and evals."""
    columns = [TextColumn("[bold]sft"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=False, disable=not lead) as progress:
        task = progress.add_task("sft", total=cfg.sft.steps, info="")

        def on_step(step: int, stats: dict[str, float]) -> None:
            info = f"loss {stats['train/loss']:.3f} lr {stats['train/lr']:.1e}"
            if cfg.sft.eval_every and step % cfg.sft.eval_every == 0 and step < cfg.sft.steps:
                acc, _ = evaluate()  # every rank: gathering sharded weights is collective
                if lead:
                    progress.console.print(f"step {step}: eval greedy accuracy {acc:.1%}")
            if not lead:
                return
            if step == min(ESTIMATE_AFTER, cfg.sft.steps):
                progress.console.print(estimate_message(step, stats["time/elapsed_s"],
                                                        cfg.sft.steps, then))
            if step % cfg.sft.log_every == 0 and not progress.console.is_terminal:
                progress.console.print(f"step {step}/{cfg.sft.steps}: {info}")
            progress.update(task, advance=1, info=info)

        return train_sft(engine, examples, cfg.sft, on_step)


def save_atomically(model, tokenizer, cfg: SFTRunConfig, result: SFTResult, out: Path,
                    base: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    save_model_dir(model, tokenizer, tmp, processor_from=base)
    cfg.save(tmp / "sft_config.yaml")
    data = asdict(result)
    data.pop("cached")
    data.pop("model_dir")
    (tmp / RESULT_FILE).write_text(json.dumps(data, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
