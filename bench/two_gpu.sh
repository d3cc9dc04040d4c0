#!/usr/bin/env bash
# Training scaling on a machine with two GPUs (1 GPU vs data=2 vs fsdp=2, each with a
# profiler trace summary), then the engine's decode generation end to end (one GPU).
#   PYTHONPATH=. bash bench/two_gpu.sh     (VARIANTS=..., MESHES=..., T_TRAIN / T_DECODE=0 to skip)
set -u
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpu.txt" 2>&1
[ "${T_TRAIN:-240}" = 0 ] || timeout -k 5 ${T_TRAIN:-240} $PY -m jrl.bench train --variants ${VARIANTS:-causal} \
  --meshes "${MESHES:-1;data=2;fsdp=2}" --steps 8 --trace /tmp/traces --json "$OUT/scaling.jsonl" \
  > "$OUT/scaling.txt" 2> "$OUT/scaling.log"; rc=$?
[ -f "$OUT/scaling.txt" ] && echo "train exit $rc" >> "$OUT/scaling.txt"
tar czf "$OUT/traces.tgz" -C /tmp traces 2>/dev/null
[ "${T_DECODE:-270}" = 0 ] || timeout -k 5 ${T_DECODE:-270} $PY -m jrl.bench decode --batches 256,1,128,64,16 \
  --budget-s $(( ${T_DECODE:-270} - 30 )) --json "$OUT/decode.jsonl" > "$OUT/decode.txt" 2> "$OUT/decode.log"; rc=$?
[ -f "$OUT/decode.txt" ] && echo "decode exit $rc" >> "$OUT/decode.txt"
cat "$OUT/gpu.txt"
for part in scaling decode; do
  [ -f "$OUT/$part.txt" ] || continue
  echo "===== $part"; grep -v '^\s*$' "$OUT/$part.txt" | tail -n 30
done
