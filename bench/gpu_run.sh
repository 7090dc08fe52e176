#!/usr/bin/env bash
# The GPU benchmarks in one go, for a lent GPU box whose python3 has torch + CUDA but not
# packtune's service dependencies: those travel as wheels in bench/.wheels (see
# bench/README.md). Writes everything under $OUT (default bench/results/gpu).
#   bash bench/gpu_run.sh
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
if [ -d bench/.wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/packtune-deps bench/.wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/packtune-deps:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' \
    | tee -a "$OUT/gpu.txt"

# 1. the GPU tests
timeout 150 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider \
    --continue-on-collection-errors 2>&1 | tee "$OUT/pytest_gpu.log" | tail -4

# 2. benchmark a: fused vs serial vs concurrent processes
timeout "${A_TIMEOUT:-270}" python3 -m bench.fused_throughput --device cuda --repeats 2 \
    --target "${A_TARGET:-0.15}" --out-dir "$OUT" --no-append 2>&1 | tee "$OUT/a_gpu.log" | tail -22

# 3. benchmark b: the digits-mlp study packed vs unpacked, embedded (SQLite), on the GPU
timeout "${B_TIMEOUT:-170}" python3 -m bench.study_walltime --modes embedded --device cuda \
    --repeats 2 --out-dir "$OUT" --no-append 2>&1 | tee "$OUT/b_gpu.log" | tail -12
