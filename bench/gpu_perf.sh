#!/usr/bin/env bash
# Every single-GPU number of docs/performance.md ("Training throughput", "Rollout
# throughput", "GRPO step") in one run, each part under a hard time limit so a slow part
# cannot starve the others (a part whose limit is 0 is skipped). Logs and JSON rows go to
# ${OUT:-bench_out}; the tables print last.
#
#   PYTHONPATH=. bash bench/gpu_perf.sh            (on the GPU machine)
#   TINY=1 PYTHONPATH=. bash bench/gpu_perf.sh     (CPU smoke run of the same commands)
set -u
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
PY=${PY:-python3}
TINY_FLAG=${TINY:+--tiny}
export PYTHONUNBUFFERED=1
# The PyTorch reference runs in a subprocess beside a live JAX process: let JAX take GPU
# memory as it needs it instead of reserving it up front, under a cap the no-remat
# training steps fit in.
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T_TRAIN=${T_TRAIN:-200} T_DECODE=${T_DECODE:-300} T_GRPO=${T_GRPO:-70}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
# stdout: the stage's table; stderr: its progress (one JSON line a row)
if [ "$T_TRAIN" != 0 ]; then
  timeout -k 5 "$T_TRAIN" $PY -m jrl.bench train $TINY_FLAG --check --torch --torch-first \
    --variants ${TRAIN_VARIANTS:-causal_unrolled,causal} --budget-s $((T_TRAIN - 75)) \
    --json "$OUT/train.jsonl" > "$OUT/train.txt" 2> "$OUT/train.log"
  echo "train exit $?" >> "$OUT/train.txt"
fi
if [ "$T_DECODE" != 0 ]; then
  timeout -k 5 "$T_DECODE" $PY -m jrl.bench decode $TINY_FLAG --batches 256,1,128,64,16 --torch \
    --torch-batches 1,256 --torch-compiled 256 --torch-timeout-s 110 \
    --budget-s $((T_DECODE - 120)) --json "$OUT/decode.jsonl" > "$OUT/decode.txt" 2> "$OUT/decode.log"
  echo "decode exit $?" >> "$OUT/decode.txt"
fi
if [ "$T_GRPO" != 0 ]; then
  timeout -k 5 "$T_GRPO" $PY -m jrl.bench grpo $TINY_FLAG --steps 3 --budget-s $((T_GRPO - 30)) \
    --json "$OUT/grpo.jsonl" > "$OUT/grpo.txt" 2> "$OUT/grpo.log"
  echo "grpo exit $?" >> "$OUT/grpo.txt"
fi

for part in train decode grpo; do
  [ -f "$OUT/$part.txt" ] || continue
  echo "===== $part"
  grep -v '^\s*$' "$OUT/$part.txt" | tail -n 24
done
