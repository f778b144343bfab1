#!/usr/bin/env bash
# One prepared device run, under 10 minutes: CUDA tests, then each GPU table, every part under its own
# timeout and written to $OUT as it finishes (a part cut short keeps what it measured); the exit status
# is the CUDA tests' (every part runs regardless). Wheels for the image's python in .whl/
# (docs/BENCHMARKS.md, "The GPU run"); the image brings torch.
# GPU_CHECK_DRY=1: every part on the CPU at a tiny size, nothing installed (tests/bench_smoke runs it,
# so a flag or path the GPU run would trip on fails here first).
# GPU_CHECK_PARTS="tests compile ...": only these parts (of: tests calibration compile offload memory
# auto full), to give one the device's few minutes when the others were measured before.
export PYTHONUNBUFFERED=1
if [ -n "${GPU_CHECK_DRY:-}" ]; then
    export PYTHONPATH=$PWD
    TINY="--quick --device cpu"  # bench_gpu*.py at their CPU size; argparse keeps the last of a flag
    TINY_AUTO="--device cpu --layers 2 --width 64 --heads 2 --seq 32 --vocab 128 --optimizer sgd --stages 2 --rounds 1"
    TINY_CAL="--device cpu --preset local_cpu_test --tiny --seq 32 --batch 2 --steps 4 --precision 32-true"
else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
    TINY="" TINY_AUTO="" TINY_CAL=""
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
    # every part imports these: a wheel missing or mismatched stops the run here, not in each part
    python3 -c "import torch, lightning, transformers, hydra, pipeckpt; print(torch.__version__, lightning.__version__, transformers.__version__, torch.cuda.get_device_name(0))" >> $OUT/gpu.txt || exit 1
    cat $OUT/gpu.txt
fi
quiet() { grep -v -i "warn\|^ *$" | tail -30; }
PARTS=" ${GPU_CHECK_PARTS:-tests calibration compile offload memory auto full} "
part() {  # part <name> <title>: prints its start (for its timeout next time); fails when not asked for
    if [[ "$PARTS" != *" $1 "* ]]; then echo "== $2: skipped (GPU_CHECK_PARTS)"; return 1; fi
    echo "== $2 at $(date -u +%T) (run started $STARTED)"
}
STARTED=$(date -u +%T)
bench() {  # bench <seconds> <out name> <args...>: one table, to $OUT/<out name>
    local seconds=$1 name=$2; shift 2
    timeout "$seconds" python3 benchmarks/bench_gpu.py --out "$OUT/$name" "$@" $TINY 2>&1 | quiet
}
TESTS_RC=0
if part tests "CUDA tests"; then
    # addopts dropped: the suite's own (-n 2) needs pytest-xdist, which the image need not have
    timeout ${T_TESTS:-70} python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -o addopts=-ra --durations=10 \
        2>&1 | tee $OUT/test_cuda.log | tail -30
    TESTS_RC=${PIPESTATUS[0]}  # the run's own status at its end: the tables are written either way
fi
# the h200_1 preset's efficiency from a measured step: HF Llama at 3.2 1B's shape, seq 4096, bf16-mixed
part calibration "calibration" &&
    timeout ${T_CAL:-80} python3 benchmarks/bench_gpu_calibrate.py --out $OUT/RESULTS_gpu_calibrate.md $TINY_CAL 2>&1 | quiet
# compiled selective vs never at 4 chunks, both shapes, bf16; reduce-overhead vs eager (GPT-2 small)
part compile "compile table" &&
    bench ${T_COMPILE:-100} RESULTS_gpu_compile.md --methods compile --plans small-bf16,medium-bf16 --rounds 2 --steps 8 --warmup 4
# offload vs always, whole stage and per layer, with the share of always's kept bytes moved off the GPU
part offload "offload table" &&
    bench ${T_OFFLOAD:-70} RESULTS_gpu_offload.md --methods offload --plans small-bf16 --rounds 2 --steps 8 --warmup 3
# the plan's predicted peaks against each stage's measured peak and the device's max_memory_allocated
part memory "memory table" &&
    timeout ${T_MEMORY:-70} python3 benchmarks/bench_gpu_memory.py --out $OUT/RESULTS_gpu_memory.md \
        --plans small-bf16,small-32,medium-bf16,medium-32 $TINY 2>&1 | quiet
# checkpoint='auto' on HF GPT-2 (seq 1024, bf16-mixed) under per-block checkpointing's measured peak
part auto "auto table" &&
    timeout ${T_AUTO:-110} python3 benchmarks/bench_hf_auto.py --device cuda --precision bf16-mixed --seq 1024 \
        --batch 8 --stages 4 --rounds 2 --out $OUT/RESULTS_gpu_auto.md $TINY_AUTO 2>&1 | quiet
# the full table (always vs loop + one forward among its rows), one round
part full "full table" && bench ${T_BENCH:-50} RESULTS_gpu.md --plans small-bf16 --rounds 1 --steps 6 --warmup 2
echo "== end at $(date -u +%T) (run started $STARTED)"
[ "$TESTS_RC" = 0 ] || echo "gpu_check: tests/test_cuda.py exited $TESTS_RC (the tables above were written anyway)"
exit "$TESTS_RC"
