#!/usr/bin/env bash
# The user-facing checks that need a GPU, in one go: the memory estimate against the device's
# free memory (a model that cannot fit is refused naming both numbers; a ViT-B/16 step at micro
# 256 is not), a short default run on the GPU, data parallel over NCCL on one GPU with the
# job's identity in the rendezvous, and a run directory's config.json re-run on the GPU.
#
#   scripts/gpu_users_check.sh [BIN] OUT_DIR
#
# Writes OUT_DIR/results.txt (one PASS/FAIL line per check) and each command's log; exits 1
# if any check failed. Prints "ALL PASS" at the end when every check passed.
set -u
BIN=${1:-target/release/vitscale}
OUT=${2:?usage: $0 [BIN] OUT_DIR}
export NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
rm -rf "$OUT"/run-*
RES=$OUT/results.txt
: > "$RES"
fails=0
check() { # name, condition result (0 = pass), detail
  if [ "$2" = 0 ]; then echo "PASS: $1" | tee -a "$RES"; else echo "FAIL: $1 ($3)" | tee -a "$RES"; fails=$((fails + 1)); fi
}
SMALL=(--set data.train_size=512 --set data.val_size=128 --set train.steps=8)

# 1. a model that cannot fit in the GPU's memory is refused before allocating
"$BIN" train --device cuda --run-dir "$OUT/run-huge" --set model.embed_dim=131072 --set model.num_heads=128 "${SMALL[@]}" >"$OUT/huge.log" 2>&1
rc=$?
ok=1
if [ $rc = 1 ] && grep -q "free memory on GPU" "$OUT/huge.log" && grep -q "estimated" "$OUT/huge.log"; then ok=0; fi
check "embed_dim 131072 refused with the estimate and the GPU's free memory (exit $rc)" $ok "see huge.log"

# 2. a real ViT-B/16 micro-256 step is not refused by the estimate, and trains
"$BIN" train --device cuda --json --run-dir "$OUT/run-b16" --set data.dataset=synthetic --set model.preset=vit_base_patch16_224 \
  --set model.num_classes=10 --set train_micro_batch_size_per_gpu=256 --set train.steps=2 --set data.train_size=512 --set data.val_size=256 \
  --set bf16.enabled=true >"$OUT/b16.log" 2>&1
check "ViT-B/16 micro 256 trains on the GPU (not refused by the estimate)" $? "see b16.log"

# 3. the default small run on the GPU, then its config.json re-run gives the same weights
"$BIN" train --device cuda --json --run-dir "$OUT/run-a" "${SMALL[@]}" >"$OUT/a.log" 2>&1
ra=$?
"$BIN" train --device cuda --json --run-dir "$OUT/run-a2" --config "$OUT/run-a/config.json" >"$OUT/a2.log" 2>&1
rb=$?
ha=$(grep -o '"weights_hash":"[0-9a-f]*"' "$OUT/a.log" | tail -1)
hb=$(grep -o '"weights_hash":"[0-9a-f]*"' "$OUT/a2.log" | tail -1)
ok=1
if [ $ra = 0 ] && [ $rb = 0 ] && [ -n "$ha" ]; then ok=0; fi
check "config.json of a GPU run re-runs it ($ha vs $hb; bf16 GPU runs need not be bitwise equal)" $ok "see a.log, a2.log"

# 4. two ranks on the one GPU over NCCL (launch --one-gpu), the rendezvous carrying the job id
"$BIN" launch --nproc-per-node 2 --one-gpu -- train --device cuda --json --run-dir "$OUT/run-dp" "${SMALL[@]}" >"$OUT/dp.log" 2>&1
check "launch --one-gpu 2 ranks over NCCL" $? "see dp.log"

# 5. the CPU fallback notice is not printed when a GPU is used
! grep -q "notice: no usable GPU" "$OUT/a.log"
check "no CPU-fallback notice on a GPU run" $? "see a.log"

if [ $fails = 0 ]; then echo "ALL PASS" | tee -a "$RES"; else echo "$fails FAILED" | tee -a "$RES"; exit 1; fi
