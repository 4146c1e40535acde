"""The README's job figures must come from the current recipe.

benchmarks/main_job.py records which warm start (its cache key: SFT config, tiny-model builder
version, SFT recipe version) and which job config (its parsed content) produced the figures: the main job's
(main_job.json) and the vision-language job's (vlm_job.json). Changing any of them without
rerunning the benchmark fails here, naming the command to run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from asyncrl.launch.sft import output_dir_for
from asyncrl.launch.train_config import TrainRunConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from main_job import config_sha256  # noqa: E402  (benchmarks/main_job.py writes the records)
RESULTS = ROOT / "benchmarks" / "results"
RECORDS = ["main_job.json", "vlm_job.json"]


def record(name: str) -> tuple[dict, str]:
    path = RESULTS / name
    assert path.is_file(), f"{path} is missing; rerun benchmarks/main_job.py"
    rec = json.loads(path.read_text())
    return rec, (f"rerun `{rec['command']}` and update the README's figures from its output")


@pytest.mark.parametrize("name", RECORDS)
def test_record_was_made_with_the_current_warm_start_recipe(name):
    rec, rerun = record(name)
    config = ROOT / rec["config"]
    warm = output_dir_for(TrainRunConfig.load(str(config)).warm_start).name
    assert rec["warm_start"] == warm, (
        f"the README's figures were measured from warm start {rec['warm_start']}, but the "
        f"current recipe builds {warm}; {rerun}")


@pytest.mark.parametrize("name", RECORDS)
def test_record_was_made_with_the_current_job_config(name):
    rec, rerun = record(name)
    digest = config_sha256(ROOT / rec["config"])
    assert rec["config_sha256"] == digest, f"{rec['config']} changed since the record; {rerun}"


@pytest.mark.parametrize("name", RECORDS)
def test_readme_quotes_the_record(name):
    (rec, rerun), readme = record(name), (ROOT / "README.md").read_text()
    s = rec["summary"]
    for figure in (f"{s['mean_initial']:.1%}", f"{s['mean_final']:.1%}",
                   f"{s['worst_final']:.1%}"):
        assert figure in readme, f"README does not quote {figure} from {name}; {rerun}"


def test_readme_quotes_the_quick_starts_timing():
    """The quick start's time from a fresh clone comes from benchmarks/quickstart_time.py."""
    rec = json.loads((RESULTS / "quickstart.json").read_text())
    readme = (ROOT / "README.md").read_text()
    minutes = f"{rec['total_seconds'] / 60:.1f} min"
    first, last = rec["accuracy_first_last"]
    for figure in (minutes, f"{first[1]:.1%}", f"{last[1]:.1%}"):
        assert figure in readme, (f"README does not quote {figure} from quickstart.json; rerun "
                                  f"`{rec['command']}` and update the quick start")
    assert rec["first"] in readme and rec["install"] in readme
