#!/usr/bin/env bash
# The planner's validation on this machine's CPU: the inputs (compute profiles of ViT-Ti/4
# 32 px at micro 4..32: one rank on every core, and each of 2 launched ranks profiling its own
# step side by side with the threads the launcher gives it; a comm bench of 2 CPU ranks, at
# the doubling sizes and at the sizes of the model's gradient buckets), the sweep they must
# predict (configs/study/plan_validation_cpu.json: 1 and 2 ranks × micro 4, 8, 16, 32, three
# rounds; each run's steady throughput is its median step, each point's the median of its
# runs, its spread half their range), then `plan --validate` and `report`. About 9 minutes on
# 2 cores.
#
#   scripts/plan_cpu.sh [BIN] [OUTDIR]
set -eu
BIN=${1:-target/release/vitscale}
OUT=${2:-plan-cpu}
mkdir -p "$OUT"
"$BIN" bench --device cpu --model vit_tiny_patch4_32 --profile-out "$OUT/profile.json" --profile-micros 4,8,16,32 --steps 20 --warmup 3
# one rank as each of 2 launched ranks runs: ⌈cores / 2⌉ threads, the other rank beside it
"$BIN" launch --nproc-per-node 2 -- bench --device cpu --model vit_tiny_patch4_32 --profile-out "$OUT/profile_2ranks.json" --profile-micros 4,8,16,32 --steps 20 --warmup 3
"$BIN" launch --nproc-per-node 2 -- bench --comm --device cpu --comm-max-bytes 33554432 --comm-buckets vit_tiny_patch4_32 --comm-iters 9 --warmup 2 --comm-out "$OUT/comm_2.json" > "$OUT/comm_2.txt"
"$BIN" sweep configs/study/plan_validation_cpu.json --out "$OUT" --resume
"$BIN" plan --validate "$OUT"
"$BIN" report "$OUT"
