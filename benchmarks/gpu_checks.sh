#!/usr/bin/env bash
# The GPU checks and benchmarks of README "On GPUs", as one bounded run on a CUDA machine:
#   bash benchmarks/gpu_checks.sh OUT_DIR [STEPS] [SECONDS_FOR_THE_WIDER_SUITE]
# STEPS: comma-separated, default tests,engine,train (under 9 minutes with their limits; add nccl
# for step 4, suite for step 5).
# Steps: 1. the `gpu`-marked tests and the engine's device tests; 2. bench_gpu_engine (0.5B, batch
# 1/64/256: the engine with and without CUDA graphs, HF generate, HF's compiled static-cache
# generate); 3. bench_gpu_train (0.5B); 4. bench_nccl_sync (0.5B; with one GPU it says it uses
# gloo); 5. suite: as much of the default suite as runs in them (device auto = the
# GPU; SUITE_TESTS names other test files). Each step has its own time limit, so one that hangs costs its limit and not the others.
# Logs and JSON records go to OUT_DIR. Python packages the machine lacks may lie as wheels in
# .whl/ (installed into /tmp/site, put first on PYTHONPATH); the repo is used in place.
set -u
out=${1:?usage: gpu_checks.sh OUT_DIR [STEPS] [SECONDS]}
steps=,${2:-tests,engine,train},
wide=${3:-120}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 ASYNCRL_CACHE=${ASYNCRL_CACHE:-/tmp/asyncrl-gpu-cache}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
py=python3
step() {  # step NAME LIMIT_S COMMAND...: runs it if STEPS names it, logs to OUT/NAME.log
  local name=$1 limit=$2; shift 2
  [[ $steps == *",$name,"* ]] || return 0
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0))s"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'| transformers', transformers.__version__, '| GPUs', torch.cuda.device_count())"; } 2>&1
step tests 150 $py -m pytest -q -p no:cacheprovider --timeout 120 -ra -m "not vllm and not ray" \
  tests/test_gpu.py tests/test_engine_device.py tests/test_static_decode.py tests/test_packed_trainer.py
step engine 270 $py benchmarks/bench_gpu_engine.py --record "$out/gpu_engine.json"
step train 90 $py benchmarks/bench_gpu_train.py --record "$out/gpu_train.json"
step nccl 120 $py benchmarks/bench_nccl_sync.py --preset qwen2.5-0.5b --record "$out/nccl_sync.json"
suite=${SUITE_TESTS:-tests/test_engine.py tests/test_train_loop.py tests/test_trainer_api.py \
  tests/test_train_engine.py tests/test_train_engine_fsdp.py tests/test_ppo_actor.py \
  tests/test_lora.py tests/test_critic.py tests/test_trainer_engine_sync.py \
  tests/test_inflight_resume.py tests/test_eval.py}
# shellcheck disable=SC2086
step suite "$wide" $py -m pytest -q -p no:cacheprovider --maxfail 15 --timeout 100 -m "not slow" $suite
