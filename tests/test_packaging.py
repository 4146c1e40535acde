"""What a built wheel carries: the C++ kernel sources the engine compiles on first use, the
`py.typed` marker, the shipped warm start, the license; and every package-data pattern names
files that exist."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_package_data_patterns_match_files():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["asyncrl"]
    assert [p for p in patterns if not list((ROOT / "asyncrl").glob(p))] == []


def test_wheel_carries_kernels_marker_and_license(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path)], check=True,
                   capture_output=True, timeout=300)
    names = zipfile.ZipFile(next(tmp_path.glob("asyncrl-*.whl"))).namelist()
    assert "asyncrl/py.typed" in names
    shipped = [p.relative_to(ROOT).as_posix() for p in (ROOT / "asyncrl/warm_starts").rglob("*")
               if p.is_file()]
    assert shipped and set(shipped) <= set(names), "the shipped warm start is not in the wheel"
    sources = [p.name for p in (ROOT / "asyncrl/inference/csrc").iterdir()]
    assert all(f"asyncrl/inference/csrc/{name}" in names for name in sources)
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith("/LICENSE")
               for n in names), names[-10:]


def test_top_level_names_resolve_and_import_asyncrl_stays_light():
    """Every name `from asyncrl import ...` offers exists; importing the package itself pulls in
    neither torch nor transformers (the names load on first use)."""
    code = ("import sys, asyncrl\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
            "assert set(asyncrl.__all__) <= set(dir(asyncrl)), 'tab completion misses names'\n"
            "missing = [n for n in asyncrl.__all__ if getattr(asyncrl, n, None) is None]\n"
            "assert missing == [], missing\n"
            "from asyncrl import Trainer, run_eval_job, open_reward, AgentWorkflow\n"
            "print(len(asyncrl.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
