"""A cached virtual environment with SGLang on CPU torch, for the integration suite.

    python tests/integration/sglang_venv.py      # builds it if needed, prints its python

SGLang brings its own pins (torch, transformers), so it lives in a venv of its own:
`${ASYNCRL_SGLANG_VENV:-~/.cache/asyncrl/sglang-venv-<version>}`; a `.complete` marker is written
only after a working install, so an interrupted build is redone. `pip install sglang` pulls CUDA
torch and CUDA-only kernels, so the venv is put together by hand: the CPU build of torch 2.13.0
(sglang pins 2.14.1, whose CPU build is not on this machine; 2.13 serves), sglang with --no-deps,
and those of its requirements that install and run without CUDA (REQUIREMENTS, pinned where
sglang pins them). Two of the packages it imports have no CPU build on PyPI, so small stand-ins
kept beside this file (sglang_standins/) are copied into the venv's site-packages: `sgl_kernel`
with the one CPU op that SGLang's CPU engine calls for a text model, and an import-only
`torchvision`; each one's docstring says what it replaces. Serve with SGLANG_USE_CPU_ENGINE=1
(attention then falls back to SGLang's torch-native backend). Measured on the 2-core machine:
about 2 minutes with pip's download cache warm, 3.5 GB (triton, which sglang imports at start-up,
is 1 GB of it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vllm_venv import run

SGLANG_VERSION = "0.5.23"
TORCH = "torch==2.13.0+cpu"  # the CPU build, from this machine's wheels; never the CUDA one
# sglang 0.5.23's requirements (its wheel's METADATA), pinned as it pins them, less those that
# need CUDA (cuda-python, flash-attn-4, flashinfer_python, humming-kernels, nvidia-*,
# nvshmem4py-cu13, quack-kernels, sgl-deep-ep, sgl-deep-gemm, sgl-flash-mla, sglang-kernel,
# tilelang, torch_memory_saver, and torchaudio, torchcodec, torchvision, built for CUDA torch),
# less timm (it requires the CUDA torchvision; only the DeepSeek-VL2 model imports it), plus
# triton, which xgrammar requires and sglang imports at start-up (it imports without a GPU).
REQUIREMENTS = (
    "aiohttp", "anthropic>=0.20.0", "apache-tvm-ffi==0.1.11", "blobfile==3.0.0", "build",
    "compressed-tensors==0.18.0", "datasets", "deepseek-recipe==0.2.0", "distro", "easydict",
    "einops", "fastapi", "gguf", "interegular", "IPython", "kernels>=0.14.1,<0.15",
    "llguidance>=1.7.6,<2.0.0", "mistral_common>=1.11.5", "modelscope", "msgspec", "ninja",
    "numba==0.65.1", "numpy", "openai==2.8.0", "openai-harmony==0.0.4", "orjson",
    "outlines==0.1.11", "packaging", "partial_json_parser", "pillow", "prometheus-client>=0.20.0",
    "psutil", "py-spy", "pybase64", "pydantic", "python-dateutil<3", "python-multipart",
    "pyzmq>=25.1.2", "regex", "requests", "scipy", "sentencepiece==0.2.1", "setproctitle",
    "smg-grpc-servicer>=0.9.0", "soundfile==0.13.1", "tiktoken", "tml-renderers==0.1.0",
    "tokenizers==0.23.2", "tqdm", "transformers==5.19.0", "triton==3.9.0", "uvicorn>=0.51",
    "uvloop", "watchfiles", "xgrammar==0.2.7", "xxhash", "zstandard",
)
PACKAGES = f"sglang-{SGLANG_VERSION} {TORCH}"  # the first part of the .complete marker
STANDINS = Path(__file__).parent / "sglang_standins"
# Imports that a server start needs, with the CPU engine on (which imports sgl_kernel's op).
IMPORT_CHECK = ("import os; os.environ['SGLANG_USE_CPU_ENGINE'] = '1'; "
                "import sglang.launch_server, sglang.srt.entrypoints.http_server, "
                "sglang.srt.configs.model_config, sglang.srt.models.qwen2, "
                "sglang.srt.mem_cache.allocation as allocation; assert allocation._is_cpu")


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "asyncrl" / f"sglang-venv-{SGLANG_VERSION}"
    return Path(os.environ.get("ASYNCRL_SGLANG_VENV", default))


def build_string() -> str:
    """What the .complete marker holds: the packages, and a digest of the stand-ins' files (an
    edited stand-in is copied in again; the packages are not reinstalled for it)."""
    digest = hashlib.sha256()
    for path in sorted(STANDINS.rglob("*.py")):
        digest.update(path.relative_to(STANDINS).as_posix().encode() + b"\0" + path.read_bytes())
    return f"{PACKAGES} standins-{digest.hexdigest()[:12]}"


def ensure_sglang_python(log=print) -> str:
    """The venv's python, building the venv first if it is missing or incomplete."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    marker = venv / ".complete"
    build = build_string()
    built = marker.read_text().strip() if marker.exists() and python.exists() else ""
    if built == build:
        return str(python)
    marker.unlink(missing_ok=True)
    if built.split(" standins-")[0] != PACKAGES:  # else an earlier build: copy the stand-ins in
        log(f"building the sglang {SGLANG_VERSION} environment in {venv} (about 2 minutes, "
            "3.5 GB)")
        pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--quiet"]
        for step in ([sys.executable, "-m", "venv", "--clear", str(venv)],
                     [*pip, "install", TORCH, *REQUIREMENTS],
                     [*pip, "install", "--no-deps", f"sglang=={SGLANG_VERSION}"]):
            run(step)
    install_standins(python)
    run([str(python), "-c", IMPORT_CHECK])
    marker.write_text(build + "\n")
    return str(python)


def install_standins(python: Path) -> None:
    """Copy sgl_kernel and torchvision from sglang_standins/ into the venv's site-packages."""
    found = subprocess.run([str(python), "-c",
                            "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True)
    site_packages = Path(found.stdout.strip())
    for package in ("sgl_kernel", "torchvision"):
        shutil.rmtree(site_packages / package, ignore_errors=True)
        shutil.copytree(STANDINS / package, site_packages / package,
                        ignore=shutil.ignore_patterns("__pycache__"))


if __name__ == "__main__":
    print(ensure_sglang_python(log=lambda m: print(m, file=sys.stderr)))
