#!/usr/bin/env bash
# The planner's sequence-parallel term validated on this machine's CPU: compute profiles of the
# built-in default ViT at micro 8..128 (one rank on every core, and each of 2 launched ranks
# profiling its own step side by side), a comm bench of 2 CPU ranks, then the sweep of
# configs/study/plan_validation_sp_cpu.json (2 ranks as 2-way data parallel and as one
# sequence-parallel group of 2, micro 16, 64, 128, three rounds) and `plan --validate`. The
# model's all-to-alls are costed from the comm bench's all-gather (docs/plan.md). A few minutes
# on 2 cores; run it on a quiet machine.
#
#   scripts/plan_sp_cpu.sh [BIN] [OUTDIR]
set -eu
BIN=${1:-target/release/vitscale}
OUT=${2:-plan-sp-cpu}
mkdir -p "$OUT"
"$BIN" bench --device cpu --model vit_builtin_default --profile-out "$OUT/profile.json" --profile-micros 8,16,32,64,128 --steps 20 --warmup 3
"$BIN" launch --nproc-per-node 2 -- bench --device cpu --model vit_builtin_default --profile-out "$OUT/profile_2ranks.json" --profile-micros 8,16,32,64,128 --steps 20 --warmup 3
"$BIN" launch --nproc-per-node 2 -- bench --comm --device cpu --comm-max-bytes 8388608 --comm-buckets vit_builtin_default --comm-iters 9 --warmup 2 --comm-out "$OUT/comm_2.json" > "$OUT/comm_2.txt"
"$BIN" sweep configs/study/plan_validation_sp_cpu.json --out "$OUT" --resume
"$BIN" plan --validate "$OUT"
