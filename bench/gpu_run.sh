#!/usr/bin/env bash
# The GPU benchmarks in one go, for a lent GPU box whose python3 has torch + CUDA but not
# packtune's service dependencies: those travel as wheels in bench/.wheels (see
# bench/README.md). Writes everything under $OUT (default bench/results/gpu).
#   bash bench/gpu_run.sh                          # every step (more than one 10-minute call)
#   STEPS="tests b f g" bash bench/gpu_run.sh      # some of them: tests a a2 a3 a4 b f g h
set -u
OUT=${OUT:-bench/results/gpu}
STEPS=${STEPS-tests a a2 a3 a4 b f g h}
want() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
mkdir -p "$OUT"
if [ -d bench/.wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
        --target /tmp/packtune-deps bench/.wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/packtune-deps:$PWD
fi
export PYTHONUNBUFFERED=1
# Everything packtune needs, and what that needs, installed? Seconds here, where a missing
# package found by the first study costs minutes of the GPU's time.
python3 -m bench.preflight 2>&1 | tee "$OUT/preflight.log" | tail -12
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
# Byte-compile what every packtune process imports, as `pip install` and the Dockerfile's
# image do: a box whose torch was installed without its .pyc files (and with
# PYTHONDONTWRITEBYTECODE set) compiles torch's source in every process, ~6 s per start.
python3 -m compileall -q -j 0 service worker migrations bench $(python3 -c '
import importlib.util as u
for name in ("torch", "numpy", "sqlalchemy", "pydantic", "fastapi", "starlette", "rich",
             "typer", "click", "httpx", "httpcore", "anyio", "yaml", "alembic", "rq", "redis",
             "optuna"):
    spec = u.find_spec(name)
    if spec and spec.submodule_search_locations:
        print(*spec.submodule_search_locations)
') >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' \
    | tee -a "$OUT/gpu.txt"

# 1. the GPU tests
want tests && timeout 150 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider \
    --continue-on-collection-errors 2>&1 | tee "$OUT/pytest_gpu.log" | tail -4

# 2. benchmark a: fused vs serial vs concurrent processes (A_TIMEOUT=0 skips it)
want a && [ "${A_TIMEOUT:-270}" != 0 ] && timeout "${A_TIMEOUT:-270}" python3 -m bench.fused_throughput --device cuda --repeats 2 \
    --target "${A_TARGET:-0.15}" --out-dir "$OUT" --no-append 2>&1 | tee "$OUT/a_gpu.log" | tail -22

# 2b. benchmark a, digits-cnn: HFTA's hand-fused convolutions against vmap's rule (A2_TIMEOUT=0 skips)
want a2 && [ "${A2_TIMEOUT:-90}" != 0 ] && timeout "${A2_TIMEOUT:-90}" python3 -m bench.fused_throughput --device cuda \
    --workloads digits-cnn --variants fused hand-fused serial --ks 8 32 --repeats 2 \
    --target "${A_TARGET:-0.15}" --out-dir "$OUT/a2" --no-append 2>&1 | tee "$OUT/a2_gpu.log" | tail -6

# 2c. benchmark a: the compiled step (torch.compile; CUDA graphs) against eager fused (A3_TIMEOUT=0 skips)
want a3 && [ "${A3_TIMEOUT:-150}" != 0 ] && timeout "${A3_TIMEOUT:-150}" python3 -m bench.fused_throughput --device cuda \
    --workloads digits-mlp digits-cnn resnet-cifar --variants fused compiled serial --ks 8 32 --repeats 2 \
    --target "${A_TARGET:-0.15}" --out-dir "$OUT/a3" --no-append 2>&1 | tee "$OUT/a3_gpu.log" | tail -12

# 2d. benchmark a in bf16, and in float32 with TF32 on and off (A4_TIMEOUT=0 skips): the
#     precision default per device is chosen from these
for run in "--precision bf16" "--tf32 on" "--tf32 off"; do
    want a4 && [ "${A4_TIMEOUT:-60}" != 0 ] && timeout "${A4_TIMEOUT:-60}" python3 -m bench.fused_throughput --device cuda \
        --workloads digits-cnn resnet-cifar --variants fused serial --ks 8 32 --repeats 2 $run \
        --target "${A_TARGET:-0.15}" --out-dir "$OUT/a4" --no-append 2>&1 | tee -a "$OUT/a4_gpu.log" | tail -6
done

# 3. benchmark b: the digits-mlp study packed vs unpacked on the GPU, with SQLite:
#    `packtune run` (embedded) and a running `packtune serve` (serve)
want b && timeout "${B_TIMEOUT:-170}" python3 -m bench.study_walltime --modes ${B_MODES:-embedded serve} \
    --device cuda --repeats "${B_REPEATS:-2}" --out-dir "$OUT" --no-append 2>&1 | tee "$OUT/b_gpu.log" | tail -12

# 4. benchmark h: a model twice the device budget, spilled vs in memory, with the bus bound
want h && timeout "${H_TIMEOUT:-120}" python3 -m bench.spill --device cuda --alternate --out-dir "$OUT" --no-append \
    2>&1 | tee "$OUT/h_gpu.log" | tail -6

# 5. benchmark f: best val_loss against wall time, packtune's samplers and Optuna, every
#    trial on the GPU (Optuna's too), 5 seeds
want f && timeout "${F_TIMEOUT:-200}" python3 -m bench.quality --device cuda \
    --seeds ${F_SEEDS:-0 1 2 3 4} --out-dir "$OUT" --no-append 2>&1 | tee "$OUT/f_gpu.log" | tail -10

# 6. benchmark g: 8 studies on one GPU at once and a small one behind a large one, against
#    the same studies one after another (serve: one runner, as on any GPU)
want g && timeout "${G_TIMEOUT:-240}" python3 -m bench.multi_study --device cuda --modes serve \
    --patterns at-once behind --out-dir "$OUT" --no-append 2>&1 | tee "$OUT/g_gpu.log" | tail -14
exit 0
