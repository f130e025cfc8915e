#!/usr/bin/env bash
# ZeRO stage 3 (partitioned weights) on CUDA ranks, every rank on GPU 0 as its own NCCL "node"
# (`vitscale launch --one-gpu`, as scripts/gpu_zero_check.sh). Checks, on the GPU machine:
#   0. `selftest --device cuda` on one rank: copy_span (f32 -> bf16 as cast, exact),
#      add_span (the partitioned gradients' accumulation, exact f32 sums) and
#      optimizer_step_master (as optimizer_step_pieces, gradients partitioned as the weights,
#      exact), the operations stage 3 adds to the CUDA backend;
#   1. equalities (default model, AdamW, GAS 4, gradient_clipping 1.0, 24 steps): stage 3 at 2
#      and 4 ranks against 1 rank at stage 0 with the same global batch (per-step loss within
#      2e-2 relative, final weights within 2e-2 of 1 + |w|: bf16 compute over other splits of
#      the batch) and against stage 2 at the same world size (loss within 1e-2, weights within
#      2e-2: the forward reads the same bf16 roundings of the same f32 weights; the gradients'
#      reductions and bias sums run in another order); every rank ends with rank 0's weights;
#      SGD (no per-element normalization): stage 3 == stage 2 at 2 ranks within 1e-4;
#   2. memory: ViT-B/16, micro 64, 3 steps on synthetic data, at 1/2/4 ranks, stages 0/2/3:
#      per rank the accounted bytes, the predicted bytes (src/train/memory.rs) and the device's
#      measured peak (the run's "memory" record). Passes when the measured drop from stage 2 to
#      stage 3 at the same world size is within 10 % of the predicted drop (the whole bf16
#      compute copy and 4·P·(1 − 1/N) of the gradients, less the resident groups, the gather
#      slots and the gradient slot).
#      The table goes to OUT/memory3.json; the predicted bytes per rank are what to compare with
#      DeepSpeed's `peers/vit_bench.py --mode deepspeed --zero 3 --micro 64` max_mem_gib (part 3).
#   3. (optional, reported) DeepSpeed ZeRO-3 in the same call when its wheels install from WHL
#      (peers/get-wheels.sh), as scripts/gpu_zero_bench.sh runs stages 0-2.
#   Results: one JSON line per check on stdout.
#
#   scripts/gpu_zero3_check.sh [BIN] [OUTDIR] [PEERS_DIR] [WHEELS_DIR]
#   (SKIP_MEMORY=1: parts 0-1 only; SKIP_EQUAL=1: parts 0 and 2-3 only; SKIP_SELFTEST=1: no part 0)
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=$(realpath "${1:-target/release/vitscale}")
OUT=$(realpath -m "${2:-gpu-zero3}")
PEERS=$(realpath -m "${3:-peers}")
WHL=$(realpath -m "${4:-.whl}")
mkdir -p "$OUT"
. "$HERE/gpu_ranks.sh"
fail=0

if [ "${SKIP_SELFTEST:-0}" != 1 ]; then
  echo "== 0. selftest: the backend operations stage 3 uses"
  "$BIN" selftest --device cuda > "$OUT/selftest.log" 2>&1
  n_ok=$(grep -cE "^  ok   (copy_span|add_span|optimizer_step_master)" "$OUT/selftest.log")
  n_bad=$(grep -cE "^  FAIL (copy_span|add_span|optimizer_step_master)" "$OUT/selftest.log")
  n_add=$(grep -cE "^  ok   add_span" "$OUT/selftest.log")
  ok=$([ "$n_bad" = 0 ] && [ "$n_ok" -ge 5 ] && [ "$n_add" -ge 1 ] && echo true || echo false)
  echo "{\"check\": \"selftest copy_span, add_span and optimizer_step_master\", \"ok\": $ok, \"passed\": $n_ok, \"failed\": $n_bad}"
  [ "$ok" = true ] || fail=1
fi

run() { # nproc stage dir args...
  local n=$1 s=$2 d=$3; shift 3
  train_ranks "$n" "$d" --device cuda --json --set zero_optimization.stage="$s" "$@"
}

if [ "${SKIP_EQUAL:-0}" != 1 ]; then
  echo "== 1. stage 3 == stage 2 == 1 rank (AdamW, GAS 4, clipping); SGD stage 3 == stage 2"
  eq=(--set train.steps=24 --set train.log_every=1 --set data.train_size=4096 --set data.val_size=512 --set train_batch_size=64
      --set gradient_accumulation_steps=4 --set gradient_clipping=1.0 --set zero_optimization.reduce_bucket_size=20000
      --set zero_optimization.stage3_param_persistence_threshold=0
      --set 'optimizer={"type":"AdamW","params":{"lr":0.001}}')
  run 1 0 "$OUT/one_s0" "${eq[@]}" || fail=1
  for n in 2 4; do
    run "$n" 2 "$OUT/w${n}_s2" "${eq[@]}" || fail=1
    run "$n" 3 "$OUT/w${n}_s3" "${eq[@]}" || { fail=1; continue; }
    compare_runs "$OUT/w${n}_s3" "$OUT/one_s0" "$n ranks stage 3 vs 1 rank stage 0" 2e-2 2e-2 "$n" || fail=1
    compare_runs "$OUT/w${n}_s3" "$OUT/w${n}_s2" "$n ranks stage 3 vs $n ranks stage 2" 1e-2 2e-2 "$n" || fail=1
  done
  sgd=("${eq[@]}" --set 'optimizer={"type":"SGD","params":{"lr":0.01,"momentum":0.9}}')
  for s in 2 3; do
    run 2 "$s" "$OUT/sgd_s$s" "${sgd[@]}" || fail=1
  done
  compare_runs "$OUT/sgd_s3" "$OUT/sgd_s2" "2 ranks stage 3 vs stage 2, SGD" 1e-4 1e-4 2 || fail=1
fi

if [ "${SKIP_MEMORY:-0}" != 1 ]; then
  echo "== 2. memory per rank: ViT-B/16, micro 64"
  mem=(--set model.preset=vit_base_patch16_224 --set model.num_classes=10 --set data.dataset=synthetic --set data.train_size=512
       --set data.val_size=64 --set train.steps=3 --set train.log_every=1 --set train_micro_batch_size_per_gpu=64
       --set gradient_accumulation_steps=1 --set train.eval_batch_size=64 --set 'optimizer={"type":"AdamW","params":{"lr":0.0001}}')
  for n in 1 2 4; do
    for s in 0 2 3; do
      [ "$n" = 1 ] && [ "$s" = 2 ] && continue
      run "$n" "$s" "$OUT/mem_w${n}_s$s" "${mem[@]}" || fail=1
    done
  done
  python3 "$HERE/memory_drops.py" "$OUT" 2 3 memory3.json || fail=1
  if [ -d "$WHL" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/ds-site "$WHL"/*.whl > "$OUT/pip.log" 2>&1; then
    echo "== 3. DeepSpeed ZeRO-3 in the same call (reported)"
    for n in 2 4; do
      (cd "$PEERS" && PYTHONPATH=/tmp/ds-site${PYTHONPATH:+:$PYTHONPATH} TORCH_CUDA_ARCH_LIST=9.0 torchrun --nproc-per-node "$n" --master-port $((27500 + RANDOM % 1000)) \
          --no-python ./hostid.sh python3 vit_bench.py --one-gpu --mode deepspeed --zero 3 --micro 64 --gas 1 --steps 3 --warmup 1 2>>"$OUT/deepspeed.err" \
        | grep '^{' | sed "s/^{/{\"world\": $n, /") || echo "DeepSpeed ZeRO-3 at $n ranks failed (see $OUT/deepspeed.err)"
    done
  else
    echo "(no DeepSpeed wheels in $WHL: part 3 skipped)"
  fi
fi
exit $fail
