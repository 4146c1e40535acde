"""`import asyncrl.api` must stay cheap: no torch, fastapi, transformers (docs/concepts/architecture.md, "Layers");
and the run configs load without the code they configure, so `--print-config` answers at once."""

import subprocess
import sys

HEAVY = ("torch", "fastapi", "transformers", "gymnasium", "numpy", "pydantic")


def test_import_api_pulls_in_no_heavy_modules():
    code = (
        "import sys, asyncrl.api\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"asyncrl.api imported {out.stdout.strip()}"


def test_run_configs_load_without_torch_or_the_engines():
    code = (
        "import sys\n"
        "from asyncrl.launch.train_config import TrainRunConfig\n"
        "from asyncrl.launch.sft_config import SFTRunConfig\n"
        "TrainRunConfig.load(None, ['inference.mode=local']), SFTRunConfig()\n"
        "print(','.join(m for m in ('torch', 'transformers', 'httpx', 'datasets', 'fastapi')\n"
        "               if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"loading the run configs imported {out.stdout.strip()}"
