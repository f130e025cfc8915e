#!/usr/bin/env bash
# The fine-tuning regularizers and activation checkpointing on one GPU (ranks sharing it as
# their own NCCL "nodes", `launch --one-gpu`). Checks, one JSON line each on stdout:
#   1. selftest --device cuda passes (scale_rows, lerp and the optimizer's learning-rate
#      factors against the CPU among its checks);
#   2. stochastic depth 0.3: 2 ranks (micro 8) against 1 rank (micro 16), same global batch,
#      SGD, 12 steps: weights within 2e-2 of 1 + |w| (bf16 over another split of the batch);
#      and the rate changes the weights (more than 1e-3);
#   3. layer decay 0.5: one SGD step from the same weights with and without it; each tensor's
#      update is its timm factor times the plain update within 2e-2 (the same gradients: the
#      factor only scales the step);
#   4. weight EMA (decay 0.6, checkpoints every step): the saved average against the update
#      rule applied to the checkpoints' weights (1e-5: both f32), and 2 ranks under ZeRO 2 (a
#      master shard: each rank averages its own pieces) against 1 rank within 2e-2;
#   5. activation checkpointing: train.recompute "blocks" against "never", 12 steps, weights
#      within 1e-2; and ViT-L/16 at 1024 px, micro 16, 2 steps with checkpointing on synthetic
#      data completes (its measured peak memory in the result).
#
#   scripts/gpu_fine_tune_check.sh [BIN] [OUTDIR]
set -u
BIN=${1:-target/release/vitscale}
OUT=${2:-gpu-fine-tune}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
fail=0
port() { echo $((29500 + RANDOM % 2000)); }
report() { # check ok detail-json
  echo "{\"check\": \"$1\", \"ok\": $2, \"detail\": $3}"
  [ "$2" = true ] || fail=1
}
run() { # nproc dir args...
  local n=$1 d=$2; shift 2
  if [ "$n" = 1 ]; then
    "$BIN" train --device cuda --json "$@" --run-dir "$d" --save-weights "$d/w.safetensors" > "$d.log" 2>&1
  else
    "$BIN" launch --nproc-per-node "$n" --one-gpu --master-port "$(port)" -- train --device cuda --json "$@" \
      --run-dir "$d" --save-weights "$d/w.safetensors" > "$d.log" 2>&1
  fi || { report "run $d" false "$(tail -5 "$d.log" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')"; return 1; }
}
# python helpers: safetensors read with the standard library (compare_runs.py's reader)
PY_LOAD="
import json, sys
sys.path.insert(0, '$(cd "$(dirname "$0")" && pwd)')
from compare_runs import read_f32_safetensors as load
def rel(a, b):
    return max(abs(x - y) / (1 + abs(y)) for k in b for x, y in zip(a[k], b[k]))
"
SGD='optimizer={"type":"SGD","params":{"lr":0.05,"momentum":0.9}}'
BASE=(--set data.train_size=2048 --set data.val_size=256 --set train.eval_every=0 --set train_batch_size=16)

# 1. selftest
if "$BIN" selftest --device cuda > "$OUT/selftest.log" 2>&1; then
  report selftest true "$(grep -c '^  ok' "$OUT/selftest.log")"
else
  report selftest false "$(grep FAIL "$OUT/selftest.log" | head -20 | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')"
fi

# 2. stochastic depth
run 1 "$OUT/dp_one" "${BASE[@]}" --set train.steps=12 --set "$SGD" --set model.drop_path_rate=0.3 --set train_micro_batch_size_per_gpu=16 \
 && run 2 "$OUT/dp_two" "${BASE[@]}" --set train.steps=12 --set "$SGD" --set model.drop_path_rate=0.3 --set train_micro_batch_size_per_gpu=8 \
 && run 1 "$OUT/dp_off" "${BASE[@]}" --set train.steps=12 --set "$SGD" --set train_micro_batch_size_per_gpu=16 \
 && python3 -c "$PY_LOAD
a, b, c = load('$OUT/dp_two/w.safetensors'), load('$OUT/dp_one/w.safetensors'), load('$OUT/dp_off/w.safetensors')
two, off = rel(a, b), rel(c, b)
print(json.dumps({'check': 'drop_path', 'ok': two < 2e-2 and off > 1e-3, 'detail': {'two_vs_one': two, 'off_vs_on': off}}))
" | tee "$OUT/dp.json"; grep -q '"ok": true' "$OUT/dp.json" 2>/dev/null || fail=1

# 3. layer decay
ONE=(--set data.train_size=256 --set data.val_size=32 --set train.eval_every=0 --set train_micro_batch_size_per_gpu=16 --set train.steps=1)
LSGD='optimizer={"type":"SGD","params":{"lr":0.5,"momentum":0,"weight_decay":0}}'
run 1 "$OUT/ld_start" "${ONE[@]}" \
 && run 1 "$OUT/ld_plain" "${ONE[@]}" --init "$OUT/ld_start/w.safetensors" --set "$LSGD" \
 && run 1 "$OUT/ld_half" "${ONE[@]}" --init "$OUT/ld_start/w.safetensors" --set "$LSGD" --set optimizer.params.layer_decay=0.5 \
 && python3 -c "$PY_LOAD
import math
w0, p, d = load('$OUT/ld_start/w.safetensors'), load('$OUT/ld_plain/w.safetensors'), load('$OUT/ld_half/w.safetensors')
depth = sum(1 for k in w0 if k.endswith('.norm1.weight'))
worst = 0.0
for k in w0:
    if k.startswith('blocks.'):
        f = 0.5 ** (depth - int(k.split('.')[1]))
    elif k.startswith('norm.'):
        f = 0.5
    elif k.startswith('head.') or k.startswith('fc_norm.'):
        f = 1.0
    else:
        f = 0.5 ** (depth + 1)
    dp = [x - y for x, y in zip(p[k], w0[k])]; dd = [x - y for x, y in zip(d[k], w0[k])]
    n = math.sqrt(sum(x * x for x in dp))
    if n == 0:
        continue
    worst = max(worst, math.sqrt(sum((y - f * x) ** 2 for x, y in zip(dp, dd))) / (f * n))
print(json.dumps({'check': 'layer_decay', 'ok': worst < 2e-2, 'detail': {'worst_ratio_error': worst}}))
" | tee "$OUT/ld.json"; grep -q '"ok": true' "$OUT/ld.json" 2>/dev/null || fail=1

# 4. weight EMA
EMA=(--set train.checkpoint_every=1 --keep-checkpoints 0 --set 'train.ema={"decay":0.6}' --set "$SGD" --set train.steps=6)
run 1 "$OUT/ema_one" "${BASE[@]}" "${EMA[@]}" --set train_micro_batch_size_per_gpu=16 \
 && run 2 "$OUT/ema_z2" "${BASE[@]}" "${EMA[@]}" --set train_micro_batch_size_per_gpu=8 --set zero_optimization.stage=2 \
 && python3 -c "$PY_LOAD
e = None
for s in range(1, 7):
    w = load('$OUT/ema_one/checkpoints/step_%06d/model.safetensors' % s)
    e = {k: list(v) for k, v in w.items()} if e is None else {k: [a + 0.4 * (b - a) for a, b in zip(e[k], w[k])] for k in e}
saved = load('$OUT/ema_one/w_ema.safetensors')
z2 = load('$OUT/ema_z2/w_ema.safetensors')
d_def, d_z2 = rel(saved, e), rel(z2, saved)
print(json.dumps({'check': 'ema', 'ok': d_def < 1e-5 and d_z2 < 2e-2, 'detail': {'vs_definition': d_def, 'zero2_two_ranks_vs_one': d_z2}}))
" | tee "$OUT/ema.json"; grep -q '"ok": true' "$OUT/ema.json" 2>/dev/null || fail=1

# 5. activation checkpointing
run 1 "$OUT/ck_never" "${BASE[@]}" --set train.steps=12 --set train_micro_batch_size_per_gpu=16 --set train.recompute=never \
 && run 1 "$OUT/ck_blocks" "${BASE[@]}" --set train.steps=12 --set train_micro_batch_size_per_gpu=16 --set train.recompute=blocks \
 && python3 -c "$PY_LOAD
d = rel(load('$OUT/ck_blocks/w.safetensors'), load('$OUT/ck_never/w.safetensors'))
print(json.dumps({'check': 'checkpointing_same_weights', 'ok': d < 1e-2, 'detail': d}))
" | tee "$OUT/ck.json"; grep -q '"ok": true' "$OUT/ck.json" 2>/dev/null || fail=1
if run 1 "$OUT/ck_large" --set data.dataset=synthetic --set data.train_size=64 --set data.val_size=16 --set model.preset=vit_large_patch16_224 \
    --set model.image_size=1024 --set model.num_classes=10 --set train_micro_batch_size_per_gpu=16 --set train.steps=2 --set train.recompute=blocks; then
  report checkpointing_vit_l_1024_micro16 true "$(grep '"kind": *"memory"' "$OUT/ck_large/metrics.jsonl" | tail -1)"
fi
exit $fail
