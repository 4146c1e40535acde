"""A cached virtual environment with the oldest transformers asyncrl supports, for .ci/run.

    python tests/transformers_floor.py     # builds it if needed, prints its python

pyproject.toml states the supported range of transformers; the default suite runs at the top of
it (what `pip install -e .` resolves), and .ci/run runs the tokenizer, model-loading and
native-decoder tests (tests/test_tokenizer_files.py, tests/test_models.py,
tests/test_engine_archs.py) again with this venv's python, at the bottom. The venv sees the main environment's packages (--system-site-packages: torch, asyncrl
itself) and holds only transformers at the floor and what that version pins differently
(tokenizers, huggingface_hub), so it builds in seconds:
`${ASYNCRL_TRANSFORMERS_FLOOR_VENV:-~/.cache/asyncrl/transformers-<version>-venv}`, with a
`.complete` marker written only after a working install.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TRANSFORMERS_FLOOR = "4.56.2"  # pyproject.toml: transformers>=4.56
# transformers 4.56 requires tokenizers>=0.22,<=0.23.0 and huggingface-hub>=0.34,<1.0
PINS = (f"transformers=={TRANSFORMERS_FLOOR}", "tokenizers>=0.22,<=0.23.0",
        "huggingface-hub>=0.34,<1.0")


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "asyncrl" / f"transformers-{TRANSFORMERS_FLOOR}-venv"
    return Path(os.environ.get("ASYNCRL_TRANSFORMERS_FLOOR_VENV", default))


def ensure_floor_python() -> str:
    """The venv's python, building the venv first if it is missing or incomplete."""
    venv = venv_dir()
    python, marker = venv / "bin" / "python", venv / ".complete"
    build = " ".join(PINS)
    if marker.exists() and python.exists() and marker.read_text().strip() == build:
        return str(python)
    marker.unlink(missing_ok=True)
    for step in ([sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(venv)],
                 [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                  *PINS],
                 [str(python), "-c", "import transformers, asyncrl.models.loading; "
                  f"assert transformers.__version__ == {TRANSFORMERS_FLOOR!r}"]):
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(step)} failed ({done.returncode}):\n"
                               f"{(done.stdout + done.stderr)[-3000:]}")
    marker.write_text(build + "\n")
    return str(python)


if __name__ == "__main__":
    print(ensure_floor_python())
