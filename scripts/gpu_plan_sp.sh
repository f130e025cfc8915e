#!/usr/bin/env bash
# The planner's sequence-parallel term on one GPU, every rank on GPU 0 (`launch --one-gpu`, each
# rank its own NCCL node over loopback): a one-rank compute profile of ViT-B/16 at 384 px (577
# tokens) at micro 2..16, the 2-rank comm bench, then a sweep of 2 ranks as 2-way data parallel
# and as one sequence-parallel group of 2 at micro 4, 8 and 16, and `plan --validate` of those
# points from the profile and the comm bench alone (docs/plan.md: time-slicing, the all-to-alls
# costed as all-gathers).
#   scripts/gpu_plan_sp.sh [BIN] [OUTDIR]
# MICROS ("4, 8, 16"), GAS ("1") and PROFILE_MICROS ("2,4,8,16") pick other points, e.g. held-out
# ones for a model changed after a first sweep: MICROS="6, 12" GAS="2".
# Exit status 0 when every step ran; the errors are reported, not judged here.
set -u
BIN=${1:-target/release/vitscale}
OUT=${2:-gpu-plan-sp}
mkdir -p "$OUT/sweep"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
fail=0
run() { # name cmd...: stdout to OUT/name.txt, stderr to OUT/name.err
  local name=$1; shift
  "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err" || { echo "FAILED: $*"; tail -5 "$OUT/$name.err"; fail=1; }
}
t0=$SECONDS
echo "== 1. compute profile (one rank)"
run profile "$BIN" bench --device cuda --model vit_base_patch16_224 --img 384 --classes 10 --profile-out "$OUT/sweep/profile.json" --profile-micros "${PROFILE_MICROS:-2,4,8,16}" --steps 10 --warmup 3
echo "   ($((SECONDS - t0)) s)"
echo "== 2. comm bench, 2 ranks on one GPU"
run comm_2 "$BIN" launch --one-gpu --nproc-per-node 2 -- bench --comm --device cuda --comm-max-bytes 67108864 --comm-iters 10 --warmup 3 --comm-out "$OUT/sweep/comm_2.json"
echo "   ($((SECONDS - t0)) s)"
echo "== 3. sweep: DP 2 and SP 2 × micro 4/8/16, then validate"
cat > "$OUT/spec.json" <<EOF
{
  "name": "plan_validation_sp_gpu",
  "description": "Sequence parallelism against data parallelism on 2 ranks sharing one GPU: ViT-B/16 at 384 px (577 tokens) on synthetic data, sequence_parallel_size 1 and 2, micro ${MICROS:-4, 8, 16}, GAS ${GAS:-1}, for vitscale plan --validate.",
  "base": {
    "model": {"preset": "vit_base_patch16_224", "image_size": 384, "num_classes": 10},
    "data": {"dataset": "synthetic", "train_size": 4096, "val_size": 64, "num_workers": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.0005, "weight_decay": 0.05}}
  },
  "set": {"train.eval_batch_size": 16},
  "grid": {"nproc": [2], "sequence_parallel_size": [1, 2], "train_micro_batch_size_per_gpu": [${MICROS:-4, 8, 16}], "gradient_accumulation_steps": [${GAS:-1}]},
  "device": "cuda",
  "steps": 15,
  "warmup_steps": 5,
  "timeout_s": 120
}
EOF
run sweep "$BIN" sweep "$OUT/spec.json" --out "$OUT/sweep" --resume --json
echo "   ($((SECONDS - t0)) s)"
run validate "$BIN" plan --validate "$OUT/sweep" --json
grep -v '^{' "$OUT/validate.txt"
echo "end ($((SECONDS - t0)) s), fail=$fail"
exit $fail
