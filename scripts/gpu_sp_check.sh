#!/usr/bin/env bash
# Sequence parallelism (DeepSpeed-Ulysses, `sequence_parallel_size`) on CUDA ranks, every rank on
# GPU 0 as its own NCCL "node" (`vitscale launch --one-gpu`, as scripts/gpu_dp_check.sh).
# Checks, on the GPU machine:
#   1. `selftest` over 2 and 4 ranks: NCCL's all_to_all (f32 and bf16) and split_groups
#      (groups of 2 and 4, a world all-reduce in flight beside a group's all-to-all), once with
#      ncclCommSplit and once with the unique-id fallback (VITSCALE_NCCL_NO_SPLIT=1);
#   2. N ranks == 1 rank on the same global batch (16 images a step, GAS 2, SGD with momentum so
#      the weights compare the gradients, 12 steps): SP 2, SP 4 and DP 2 × SP 2, with the class
#      token pool (17 tokens: split unevenly) and the average pool over 16 patch tokens, SP 2
#      under activation checkpointing, and DP 2 × SP 2 at ZeRO stage 3. Tolerances for bf16
#      compute: per-step loss within 2e-2 relative and final weights within 1e-2 of 1 + |w|
#      (the attention sees bf16 qkv either way; what differs is the order of the bf16 GEMMs'
#      row blocks and the group's sums of partial gradients), every rank ending with rank 0's
#      weights hash.
#   3. activation memory per rank: ViT-L/16 at 1024 px (4 097 tokens), 2 images a step, 3
#      steps on synthetic data, on 1 rank and as SP 2 and SP 4: each rank's measured peak (the
#      run's "memory" record) against config.json's prediction (`plan.memory`). Passes when the
#      measured drop of the largest rank's peak from 1 rank to SP 2 and SP 4 is within 15 % of
#      the predicted drop (the activations ÷ SP; the weights and optimizer state stay whole).
#   Results: one JSON line per check on stdout.
#
#   scripts/gpu_sp_check.sh [BIN] [OUTDIR]
#   SKIP_SELFTEST=1: no part 1; SELFTEST_RANKS ("2 4") and SELFTEST_NOSPLIT ("0 1"): part 1's
#   world sizes and split paths; SKIP_PARITY=1: no part 2; SKIP_MEMORY=1: no part 3.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${1:-target/release/vitscale}
OUT=${2:-gpu-sp}
mkdir -p "$OUT"
. "$HERE/gpu_ranks.sh"
fail=0

if [ "${SKIP_SELFTEST:-0}" != 1 ]; then
  echo "== 1. selftest: NCCL all_to_all and groups"
  for n in ${SELFTEST_RANKS:-2 4}; do
    for nosplit in ${SELFTEST_NOSPLIT:-0 1}; do
      log="$OUT/selftest_w${n}_nosplit$nosplit.log"
      VITSCALE_NCCL_NO_SPLIT=$nosplit "$BIN" launch --nproc-per-node "$n" --one-gpu --master-port "$(port)" -- selftest --device cuda > "$log" 2>&1
      rc=$?
      bad=$(grep -cE "^  FAIL" "$log")
      a2a=$(grep -cE "^  ok   comm all_to_all" "$log")
      grp=$(grep -cE "^  ok   comm (all_reduce|all_to_all) in groups" "$log")
      ok=$([ "$rc" = 0 ] && [ "$bad" = 0 ] && [ "$a2a" -ge 2 ] && [ "$grp" -ge 2 ] && echo true || echo false)
      echo "{\"check\": \"selftest $n ranks, VITSCALE_NCCL_NO_SPLIT=$nosplit\", \"ok\": $ok, \"rc\": $rc, \"failed\": $bad, \"all_to_all_ok\": $a2a, \"group_checks_ok\": $grp}"
      [ "$ok" = true ] || { fail=1; grep -E "FAIL|error" "$log" | head -10; }
    done
  done
fi

if [ "${SKIP_PARITY:-0}" != 1 ]; then
echo "== 2. N ranks == 1 rank"
common=(--device cuda --json --set train.steps=12 --set train.log_every=1 --set data.train_size=4096 --set data.val_size=256
        --set train_batch_size=16 --set gradient_accumulation_steps=2
        --set 'optimizer={"type":"SGD","params":{"lr":0.05,"momentum":0.9}}')
run() { # nproc dir args...
  local n=$1 d=$2; shift 2
  train_ranks "$n" "$d" "${common[@]}" "$@"
}

compare() { # dir one label world (bf16 tolerances: loss 2e-2, weights 1e-2)
  compare_runs "$1" "$2" "$3" 2e-2 1e-2 "$4"
}

for pool in token avg; do
  extra=()
  [ "$pool" = avg ] && extra=(--set model.class_token=false --set 'model.global_pool="avg"')
  run 1 "$OUT/one_$pool" "${extra[@]}" || { fail=1; continue; }
  for layout in "2 2" "4 4" "4 2"; do
    set -- $layout
    n=$1 sp=$2
    d="$OUT/w${n}_sp${sp}_$pool"
    run "$n" "$d" "${extra[@]}" --set sequence_parallel_size="$sp" || { fail=1; continue; }
    compare "$d" "$OUT/one_$pool" "$n ranks, SP $sp (DP $((n / sp))), $pool pool vs 1 rank" "$n" || fail=1
  done
done
run 2 "$OUT/w2_sp2_ckpt" --set sequence_parallel_size=2 --set 'train.recompute="blocks"' || fail=1
[ -d "$OUT/w2_sp2_ckpt" ] && { compare "$OUT/w2_sp2_ckpt" "$OUT/one_token" "2 ranks, SP 2, activation checkpointing vs 1 rank" 2 || fail=1; }
# ZeRO-3 under sequence parallelism: weights partitioned over all 4 ranks, gathered per block
if run 4 "$OUT/w4_sp2_z3" --set sequence_parallel_size=2 --set zero_optimization.stage=3; then
  compare "$OUT/w4_sp2_z3" "$OUT/one_token" "4 ranks, SP 2 (DP 2), ZeRO-3 vs 1 rank" 4 || fail=1
else
  fail=1
fi
fi

if [ "${SKIP_MEMORY:-0}" != 1 ]; then
  echo "== 3. activation memory per rank: ViT-L/16 1024 px"
  mem=(--device cuda --json --set model.preset=vit_large_patch16_224 --set model.image_size=1024 --set model.num_classes=10
       --set data.dataset=synthetic --set data.train_size=64 --set data.val_size=4 --set train.steps=3 --set train.log_every=1
       --set train_batch_size=2 --set gradient_accumulation_steps=1 --set train.eval_batch_size=2
       --set 'optimizer={"type":"AdamW","params":{"lr":0.0001}}')
  for sp in 1 2 4; do
    if [ "$sp" = 1 ]; then train_ranks 1 "$OUT/mem_sp1" "${mem[@]}" || fail=1
    else train_ranks "$sp" "$OUT/mem_sp$sp" "${mem[@]}" --set sequence_parallel_size="$sp" || fail=1; fi
  done
  python3 - "$OUT" <<'PY' || fail=1
import json, os, sys
out, GIB = sys.argv[1], 2**30
def peaks(d, n):
    got = []
    for r in range(n):
        rd = d if r == 0 else os.path.join(d, "rank%d" % r)
        rec = [json.loads(l) for l in open(os.path.join(rd, "metrics.jsonl")) if '"kind":"memory"' in l.replace(" ", "")]
        got.append((rec[0]["measured_peak"] or 0) / GIB if rec else None)
    return got
rows, ok = {}, True
for sp in (1, 2, 4):
    d = os.path.join(out, "mem_sp%d" % sp)
    if not os.path.isdir(d):
        ok = False
        continue
    plan = json.load(open(os.path.join(d, "config.json")))["plan"]["memory"]
    rows[sp] = {"sp": sp, "measured_peak_gib": peaks(d, sp), "predicted_gib": plan["total"] / GIB, "predicted_activations_gib": plan["activations"] / GIB}
    print(json.dumps(rows[sp]))
drops = []
for sp in (2, 4):
    if 1 not in rows or sp not in rows or None in rows[sp]["measured_peak_gib"] + rows[1]["measured_peak_gib"]:
        ok = False
        continue
    dm = max(rows[1]["measured_peak_gib"]) - max(rows[sp]["measured_peak_gib"])
    dp = rows[1]["predicted_gib"] - rows[sp]["predicted_gib"]
    good = dp > 0 and abs(dm - dp) <= 0.15 * dp
    ok &= good
    drops.append({"sp": sp, "measured_drop_gib": round(dm, 3), "predicted_drop_gib": round(dp, 3), "ok": good})
print(json.dumps({"check": "SP activation memory: measured drop from 1 rank within 15 % of the predicted", "ok": ok, "drops": drops}))
sys.exit(0 if ok else 1)
PY
fi
exit $fail
