"""What a built wheel carries: the C++ kernel sources the engine compiles on first use, the
`py.typed` marker, the license; and every package-data pattern names files that exist."""

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
    sources = [p.name for p in (ROOT / "asyncrl/inference/csrc").iterdir()]
    assert all(f"asyncrl/inference/csrc/{name}" in names for name in sources)
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith("/LICENSE")
               for n in names), names[-10:]
