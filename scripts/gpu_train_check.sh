#!/usr/bin/env bash
# Training on the GPU, checked against the CPU: the default built-in run and a CIFAR-format
# directory on `--device cuda` (the latter twice: activations regenerated as `auto` picks at
# this size, then all kept, which on an H200 saves the GELU derivative instead of pre), the time
# to the first step with a warm kernel cache, and (when torch + timm are importable) timm
# loading weights that vitscale exported.
#
#   scripts/gpu_train_check.sh BIN CIFAR_DIR OUTDIR [EXPORT_DIR FIXTURE_DIR REFERENCE_DIR]
set -u
BIN=$1; CIFAR=$2; OUT=$3; EXPORTS=${4:-}; FIXTURES=${5:-}; REF=${6:-}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

echo "== time to first step (second run: warm kernel cache)"
for i in 1 2; do
  s=$(date +%s.%N)
  "$BIN" train --device cuda --run-dir "$OUT/first$i" --set train.steps=1 --set data.train_size=256 --set data.val_size=64 >/dev/null 2>&1
  e=$(date +%s.%N)
  echo "run $i: $(python3 -c "print(round($e - $s, 2))") s for process start → 1 step + eval of 64 images"
done | tee "$OUT/first_step.txt"

echo "== default built-in run on the GPU"
"$BIN" train --device cuda --json --run-dir "$OUT/builtin" 2>"$OUT/builtin.err" | tail -n 1 | tee "$OUT/builtin.json"
grep -E "^eval|warning" "$OUT/builtin.err" | tail -n 4

echo "== CIFAR-format directory on the GPU (same config as the CPU reference run)"
"$BIN" train --device cuda --json --run-dir "$OUT/cifar" --set data.dataset=cifar10 --set "data.path=$CIFAR" \
  --set 'model={"image_size":32,"patch_size":4,"embed_dim":64,"depth":3,"num_heads":4}' --set train.epochs=5 \
  2>"$OUT/cifar.err" | tail -n 1 | tee "$OUT/cifar.json"
grep -E "^eval" "$OUT/cifar.err"

echo "== the same with every activation kept (train.recompute=never: on an H200 the MLP saves gelu' instead of pre)"
"$BIN" train --device cuda --json --run-dir "$OUT/cifar_keep" --set data.dataset=cifar10 --set "data.path=$CIFAR" \
  --set 'model={"image_size":32,"patch_size":4,"embed_dim":64,"depth":3,"num_heads":4}' --set train.epochs=5 \
  --set train.recompute=never 2>"$OUT/cifar_keep.err" | tail -n 1 | tee "$OUT/cifar_keep.json"
grep -E "^eval" "$OUT/cifar_keep.err"

if [ -n "$EXPORTS" ] && python3 -c 'import timm' 2>/dev/null; then
  echo "== timm loads vitscale exports"
  for n in cls avg; do
    python3 "$REF/make_fixtures.py" --check-export "$EXPORTS/timm_${n}_export.safetensors" \
      --fixture "$FIXTURES/timm_${n}.safetensors" 2>&1 | tail -n 1
  done | tee "$OUT/timm_export.txt"
fi
