"""The README's main-job figures must come from the current recipe.

benchmarks/main_job.py records which warm start (its cache key: SFT config, tiny-model builder
version, SFT recipe version) and which main-job config produced the figures. Changing any of them
without rerunning the benchmark fails here, naming the command to run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from asyncrl.launch.sft import output_dir_for
from asyncrl.launch.train_config import TrainRunConfig

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "results" / "main_job.json"
RERUN = ("rerun `python benchmarks/main_job.py --seeds 3 --fresh-cache` and update the README's "
         "main-job figures from its output")


def record() -> dict:
    assert RECORD.is_file(), f"{RECORD} is missing; {RERUN}"
    return json.loads(RECORD.read_text())


def test_record_was_made_with_the_current_warm_start_recipe():
    rec = record()
    config = ROOT / rec["config"]
    warm = output_dir_for(TrainRunConfig.load(str(config)).warm_start).name
    assert rec["warm_start"] == warm, (
        f"the README's figures were measured from warm start {rec['warm_start']}, but the "
        f"current recipe builds {warm}; {RERUN}")


def test_record_was_made_with_the_current_main_job_config():
    rec = record()
    digest = hashlib.sha256((ROOT / rec["config"]).read_bytes()).hexdigest()
    assert rec["config_sha256"] == digest, f"{rec['config']} changed since the record; {RERUN}"


def test_readme_quotes_the_record():
    rec, readme = record(), (ROOT / "README.md").read_text()
    s = rec["summary"]
    for figure in (f"{s['mean_initial']:.1%}", f"{s['mean_final']:.1%}",
                   f"{s['worst_final']:.1%}"):
        assert figure in readme, f"README does not quote {figure} from {RECORD.name}; {RERUN}"
