#!/usr/bin/env bash
# One prepared device run: CUDA tests, then the GPU tables (each written to $OUT when done).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, lightning, transformers; print(torch.__version__, lightning.__version__, transformers.__version__, torch.cuda.get_device_name(0))" | tee -a $OUT/gpu.txt
timeout ${T_TESTS:-150} python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -x --durations=10 2>&1 | tee $OUT/test_cuda.log | tail -40
timeout ${T_QUICK:-60} python3 benchmarks/bench_gpu.py --quick 2>&1 | tail -5
timeout ${T_BENCH:-300} python3 benchmarks/bench_gpu.py --plans ${PLANS:-small-bf16,medium-bf16} --rounds ${ROUNDS:-2} --steps 8 --warmup 3 --out $OUT/RESULTS_gpu.md 2>&1 | grep -v -i "warn\|^ *$" | tail -60
