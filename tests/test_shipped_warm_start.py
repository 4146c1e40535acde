"""The main job's warm start ships in the package (asyncrl/warm_starts/) and is its recipe's.

Its directory is named by the current recipe's cache key (nothing stale beside it), the config
saved in it is `configs/sft_tiny.yaml`, a fresh cache takes it without training, its weights score
the held-out accuracy recorded with it, and the recipe's first steps, trained again here, follow
the loss curve recorded with it. The whole recipe is not retrained here: it takes minutes, and
float sums that differ between CPUs move a retrained model's greedy accuracy by points (the
recipe's result is shipped for that reason; asyncrl/warm_starts/README.md).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from asyncrl.launch.sft import (
    RESULT_FILE,
    SHIPPED_ROOT,
    cache_key,
    greedy_accuracy,
    run_sft_job,
    shipped_dir,
)
from asyncrl.launch.sft_config import SFTRunConfig
from asyncrl.launch.train_config import TrainRunConfig

ROOT = Path(__file__).resolve().parent.parent
REBUILD = ("build it with `asyncrl sft configs/sft_tiny.yaml`, then replace the directory in "
           "asyncrl/warm_starts/ with the cache's (asyncrl/warm_starts/README.md)")


@pytest.fixture(scope="module")
def recipe() -> SFTRunConfig:
    return TrainRunConfig.load(str(ROOT / "configs" / "train_tiny.yaml")).warm_start


@pytest.fixture(scope="module")
def shipped(recipe) -> Path:
    out = shipped_dir(recipe)
    assert out is not None, (f"no warm start ships for the main job's recipe "
                             f"(tiny-sft-{cache_key(recipe)}); {REBUILD}")
    return out


def recorded(shipped: Path) -> dict:
    return json.loads((shipped / RESULT_FILE).read_text())


def test_only_the_main_jobs_warm_start_ships(shipped):
    others = sorted(d.name for d in SHIPPED_ROOT.iterdir() if d.is_dir() and d != shipped)
    assert others == [], f"stale warm starts in asyncrl/warm_starts/: {others}"


def test_the_shipped_one_was_made_by_configs_sft_tiny_yaml(recipe, shipped):
    assert cache_key(SFTRunConfig.load(str(ROOT / "configs" / "sft_tiny.yaml"))) == \
        cache_key(recipe), "configs/sft_tiny.yaml is no longer the main job's warm start"
    saved = SFTRunConfig.load(str(shipped / "sft_config.yaml"))
    assert cache_key(saved) == cache_key(recipe), (
        f"its sft_config.yaml is another recipe; {REBUILD}")


def test_a_fresh_cache_takes_the_shipped_one_without_training(recipe, shipped, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    out = io.StringIO()
    result = run_sft_job(recipe, Console(file=out, width=200))
    assert Path(result.model_dir) == shipped and result.cached
    assert "shipped" in out.getvalue() and "No cached SFT warm start" not in out.getvalue()
    assert result.eval_accuracy == recorded(shipped)["eval_accuracy"]


def test_its_weights_score_the_recorded_accuracy(recipe, shipped):
    from asyncrl.models.loading import load_causal_lm, load_tokenizer

    model = load_causal_lm(shipped, "float32").eval()
    rows = recipe.data.build().eval_rows()[: recipe.sft.eval_size]
    acc = greedy_accuracy(model, load_tokenizer(shipped), rows, recipe.sft.eval_max_new_tokens,
                          recipe.model.template_kwargs())
    # another CPU's fp32 sums may flip a near tie or two between the top two answers
    assert abs(acc - recorded(shipped)["eval_accuracy"]) <= 3 / len(rows), acc


def test_the_recipes_first_steps_follow_the_recorded_loss_curve(recipe, shipped):
    """The recipe's first 20 steps trained again (the tiny model built from its seed, the noisy
    demonstrations, the optimizer and its schedule over all the steps) give the losses recorded
    at steps 10 and 20, within what another CPU's float sums change that early."""
    import torch

    from asyncrl.models.loading import load_causal_lm, load_tokenizer, resolve_model_dir
    from asyncrl.train.engine import HFTrainEngine
    from asyncrl.train.sft import build_examples, train_sft, with_label_noise

    torch.manual_seed(recipe.sft.seed)  # as run_sft_job does
    base = resolve_model_dir(recipe.model, recipe.tiny)
    engine = HFTrainEngine(load_causal_lm(base, recipe.model.dtype), recipe.train,
                           total_steps=recipe.sft.steps)
    rows = with_label_noise(recipe.data.build().train_rows(), recipe.sft.label_noise,
                            recipe.sft.label_noise_offset, recipe.sft.seed)
    examples = build_examples(load_tokenizer(base), rows, recipe.model.template_kwargs())
    before = torch.get_num_threads()
    torch.set_num_threads(recorded(shipped)["threads"])  # the recorded order of the sums
    try:
        history = train_sft(engine, examples, recipe.sft.model_copy(update={"steps": 20}))
    finally:
        torch.set_num_threads(before)
    curve = dict((int(step), loss) for step, loss in recorded(shipped)["loss_curve"])
    for step in (10, 20):
        assert history[step - 1]["train/loss"] == pytest.approx(curve[step], abs=5e-3), step
