#!/usr/bin/env bash
# Downloads into .whl/ the Python packages asyncrl needs that the device machine's CUDA image lacks
# (it has torch, transformers, numpy, httpx, pytest...; no package registry), for Python 3.12 x86-64.
# gpu_checks.sh installs whatever lies in .whl/ into /tmp/site. Run here, in the repo root:
#   bash benchmarks/gpu_wheels.sh   (about 7 MB; name .whl in the device call's carry)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
rm -rf .whl  # one version of each package (pip refuses two)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic==2.13.4 pydantic_core==2.46.4 annotated-types typing-inspection \
  fastapi starlette opentelemetry-api uvicorn \
  openai distro jiter httpx2 httpcore2 truststore \
  math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2 \
  gymnasium farama-notifications pebble
ls .whl
