"""`import asyncrl.api` must stay cheap: no torch, fastapi, transformers (ARCHITECTURE.md, "Layers")."""

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
