#!/usr/bin/env bash
# The GPU re-check in one call (bench/RESULTS.md, "GPU re-check, fifteenth session"): the
# gpu-marked tests, the index's kernel check and timings (bench/gpu.py), and serving on the GPU
# vs the CPU (bench/serving.py, ours only), on a lent GPU machine whose Python lacks some of our
# packages. Run from the repository root (a clean `git archive` of the commit under test does),
# with the missing packages as cp312 wheels in $WHL:
#
#   OUT=/tmp/out WHL=.whl bash bench/gpu_check.sh
#
# Wheels (what the gpu tests, bench/gpu.py and bench/serving.py import that the machine's image
# lacks or has at another version; exact versions from constraints.txt): faiss-cpu, pydantic,
# pydantic-core, annotated-types, typing-inspection, typing-extensions, starlette, tritonclient,
# python-rapidjson, grpcio, grpcio-health-checking, protobuf, typer, click. Not carried:
# fbgemm-gpu (its CUDA build is ~465 MB; without it the tables take the torch path, and training,
# which needs fbgemm's TBE, cannot run: test_tiering's fixture errors and the served model is
# untrained, --epochs 0).
#
# Every step has a time limit cut to what is left of $GPU_CHECK_BUDGET_S (default 470 s: with
# the wheels and the kernel builds, one run of about 8 minutes), so one hang cannot take the
# whole lease; a step with under 15 s left is skipped. The figures of the GPU targets, in one
# run: the index alone at 1M (one query's p50, unfiltered and 5 %; K 100 and 1000; filters 50 /
# 5 / 0.5 % and none), at 10M x 64 and x 128 (a batch of 1024 vs GEMM + topk, with recall), and
# served end to end (`bench/serving.py --device cuda` vs `--device cpu`: p50 at 1 client, max
# q/s at p99 <= 20 ms), unfiltered and with every request filtered (`--filter`, passing about
# 5 % of the catalog; $SERVING_FILTERS, default "none 5", any of none 50 5 0.5: the filtered
# runs take fewer client counts, 1,32,128, to stay in the budget). $GPU_CHECK_STEPS picks steps
# (default all: pytest,gpu,gpu10m,device,hostcache,serving,cpu; hostcache: the host tier's HBM
# cache, bench/host_cache.py, into gpu_host_cache.json). Writes into $OUT: gpu_check.log
# (everything printed), gpu_pytest.log, gpu.json, gpu_10m_64.json, gpu_10m_128.json,
# gpu_device.json, serving_cuda.json, serving_cpu.json (unfiltered), serving_cuda_f5.json,
# serving_cpu_f5.json (filtered, one pair per filter), gpu_cpu.json. $SERVING_ITEMS: the served
# catalog (default 200k; the targets' 1M and 10M need a longer run).
set -u
OUT=${OUT:-/tmp/gpu_check}
WHL=${WHL:-.whl}
BUDGET=${GPU_CHECK_BUDGET_S:-470}
ITEMS=${SERVING_ITEMS:-200000}
FILTERS=${SERVING_FILTERS:-none 5}
STEPS=,${GPU_CHECK_STEPS:-pytest,gpu,gpu10m,device,hostcache,serving,cpu},
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)

left() { echo $((BUDGET - ($(date +%s) - T0))); }

# step NAME MAX_S CMD...: runs CMD under `timeout` (MAX_S, or what is left if less)
step() {
    local name=$1 max=$2 l t s rc
    shift 2
    l=$(left)
    t=$((max < l ? max : l))
    if ((t < 15)); then
        echo "== $name: SKIPPED ($l s of the budget left)"
        return 0
    fi
    echo "== $name: start (limit $t s, $l s left)"
    s=$(date +%s)
    timeout -k 5 "$t" "$@"
    rc=$?
    echo "== $name: rc $rc in $(($(date +%s) - s)) s$( ((rc == 124 || rc == 137)) && echo ' (TIMED OUT)')"
    return 0
}

main() {
echo "== commit: $(cat COMMIT 2>/dev/null || echo unknown)"
if compgen -G "$WHL/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHL"/*.whl || { echo "== wheels: install FAILED"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    echo "== wheels installed in $(($(date +%s) - T0)) s: $(ls "$WHL" | tr '\n' ' ')"
else
    echo "== wheels: none in $WHL, using what is installed"
fi

# The C++ kernels compile at first use (common/cpp_extension.py), one after another inside the
# first test that needs them; here all four build at once, in the background, while the tests
# start (a test that needs one waits on its build lock).
for k in "retrieval.index.scan:int8_isa" "retrieval.index.kmeans:build_kernel" \
    "sharded_tables.idmap:build_kernel" "sharded_tables.pooled_lookup:build_kernel"; do
    (timeout -k 5 300 python3 -c "import time, importlib; t = time.time(); \
m = importlib.import_module('${k%%:*}'); getattr(m, '${k##*:}')(); \
print('== kernel ${k}: built in %.1f s' % (time.time() - t))" ||
        echo "== kernel $k: FAILED") &
done

nvidia-smi -L
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc
python3 - <<'EOF'
import importlib, platform, torch, triton
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| triton", triton.__version__, "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")
for name in ("numpy", "faiss", "grpc", "google.protobuf", "pydantic", "pydantic_core", "starlette",
             "tritonclient", "typer", "click", "rich", "pyarrow", "prometheus_client", "hypothesis",
             "pytest", "fbgemm_gpu"):
    try:
        m = importlib.import_module(name)
        print(f"  {name} {getattr(m, '__version__', '?')} ({m.__file__})")
    except Exception as e:  # noqa: BLE001
        print(f"  {name}: not importable: {type(e).__name__}: {e}")
EOF

# 1. the gpu-marked tests (their files only: collecting the whole suite needs packages that are
# not here)
[[ $STEPS == *,pytest,* ]] && step "pytest -m gpu" 60 bash -c "set -o pipefail; python3 -m pytest -m gpu -q -rA -p no:cacheprovider \
    $(grep -rl 'mark.gpu' tests | sort | tr '\n' ' ') 2>&1 | tee '$OUT/gpu_pytest.log'"
wait # the kernel builds (normally long done)

# 2. the index alone at 1M: kernel vs reference on the device, then whole searches vs GEMM + topk,
# one query and a batch of 1024, K 100 and 1000, no filter and filters passing 50 / 5 / 0.5 %
[[ $STEPS == *,gpu,* ]] && step "bench/gpu.py cuda 1M" 75 python3 bench/gpu.py --device cuda --check --threads "$(nproc)" \
    --sizes 1000000 --batches 1,1024 --ks 100,1000 --selectivities 1,0.5,0.05,0.005 \
    --nprobes 16,32,64 --budget-s 0.1 --out "$OUT/gpu.json"

# 2b. the index alone at 10M, 64-d and 128-d: a batch of 1024 vs GEMM + topk, recall@100 against
# exact search, unfiltered and 5 %
for dim in 64 128; do
    [[ $STEPS == *,gpu10m,* ]] && step "bench/gpu.py cuda 10M x $dim" 70 python3 bench/gpu.py --device cuda \
        --threads "$(nproc)" --sizes 10000000 --dim "$dim" --batches 1024 --ks 100 \
        --selectivities 1,0.05 --nprobes 16,32,64 --budget-s 0.1 --out "$OUT/gpu_10m_$dim.json"
done

# 2c. the device path (the plan decided on the device, fixed shapes): one query's p50 on the index
# alone at 1M, unfiltered and 5 %: the host-planned search vs the device path eager and graphed
[[ $STEPS == *,device,* ]] && step "bench/gpu_device_path.py cuda 1M" 40 python3 bench/gpu_device_path.py \
    --device cuda --size 1000000 --batches 1,32 --k 100 --selectivities 1,0.05 --budget-s 0.1 \
    --out "$OUT/gpu_device.json"

# 2d. the host tier's HBM cache: one 1M x 64 INT8 table, Zipf(1.1) batches of 256 x 50 ids, the
# host tier uncached vs cached (eager and as one graph) vs the device tier, hit rate and ms
[[ $STEPS == *,hostcache,* ]] && step "bench/host_cache.py cuda" 30 python3 bench/host_cache.py \
    --device cuda --out "$OUT/gpu_host_cache.json"

# 3. served end to end: the same model (untrained, --epochs 0: no fbgemm here to train with)
# served by `recserve serve model` on the GPU (loaded on cuda: the device backend and the whole
# forward's graphs), then on the CPU (one process, and one per core); p50 at 1 client and the
# max q/s at p99 <= 20 ms; then each filter of $SERVING_FILTERS the same way
if [[ $STEPS == *,serving,* ]] && python3 -c "import recserve.cli, serving.frontends.recommend_grpc, serving.frontends.kserve_grpc, \
serving.frontends.kserve_http, tritonclient.grpc" 2>&1; then
    SERVE=(python3 bench/serving.py --small --items "$ITEMS" --epochs 0 --seconds 2
        --warmup-s 0.5 --p99-ms 20 --startup-timeout-s 75)
    for f in $FILTERS; do
        if [[ $f == none ]]; then tag="" levels=1,8,32,64,128; else tag="_f$f" levels=1,32,128; fi
        step "bench/serving.py cuda, filter $f" 75 "${SERVE[@]}" --concurrency "$levels" \
            --filter "$f" --systems ours-1proc --device cuda --out "$OUT/serving_cuda$tag.json"
        if [[ ! -f $OUT/serving_cuda$tag.json && $f == none ]]; then # the log went with its folder
            step "warm-up on cuda, with a traceback" 30 python3 - <<'EOF'
import sys, traceback
sys.path.append("bench")  # after the root: bench/serving.py is not the package
from bench_model import trained_model
from retrieval.artifact import served_on
from serving.engine.runner import ModelRunner
_, model = trained_model(300, 20000, 0)
model = model.to("cuda")
served_on(model.index, "cuda")  # as a load onto the GPU chooses: the whole forward's graphs
try:
    ModelRunner(model, "diag", 1).warmup()
    print("warm-up on cuda: ok")
except Exception:
    traceback.print_exc()
EOF
        fi
        step "bench/serving.py cpu, filter $f" 65 "${SERVE[@]}" --concurrency "$levels" \
            --filter "$f" --systems ours-1proc,ours --device cpu --out "$OUT/serving_cpu$tag.json"
    done
else
    echo "== serving: not run (not asked for, or the serving stack does not import)"
fi

# 4. if time is left: our CPU path on this machine's cores, the same 1M workload
[[ $STEPS == *,cpu,* ]] && step "bench/gpu.py cpu 1M" 60 python3 bench/gpu.py --device cpu --threads "$(nproc)" \
    --sizes 1000000 --batches 1,1024 --ks 100 --selectivities 1,0.05 --nprobes 16,32,64 \
    --budget-s 0.1 --out "$OUT/gpu_cpu.json"

echo "== done in $(($(date +%s) - T0)) s"
ls -la "$OUT"
}

main 2>&1 | tee "$OUT/gpu_check.log"
