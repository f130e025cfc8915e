#!/usr/bin/env bash
# The training loop of two vitscale binaries on the GPU machine, side by side: the same runs
# (one rank with GAS 4, clipping, smoothing and a cosine schedule; two ranks sharing the GPU at
# ZeRO 0 and 2) must end with the same weights hash, and `selftest` of B must pass; then
# scripts/gpu_ab.sh benchmarks both.
#   scripts/gpu_trainer_ab.sh A_BIN B_BIN OUTDIR
A=$1; B=$2; O=$3; mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cfg='{"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
 "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 10}},
 "train": {"steps": 40, "label_smoothing": 0.1, "seed": 3, "eval_every": 20}}'
echo "$cfg" > "$O/gas4.json"
hash() { grep -o '"weights_hash":"[0-9a-f]*"' "$1" | tail -1; }
for who in A B; do
  bin=${!who}
  "$bin" train --device cuda --config "$O/gas4.json" --run-dir "$O/$who-1r" --json > "$O/$who-1r.out" 2> "$O/$who-1r.err"
  "$bin" launch --one-gpu --nproc-per-node 2 -- train --device cuda --config "$O/gas4.json" --set train_micro_batch_size_per_gpu=16 --run-dir "$O/$who-2r" --json > "$O/$who-2r.out" 2> "$O/$who-2r.err"
  "$bin" launch --one-gpu --nproc-per-node 2 -- train --device cuda --config "$O/gas4.json" --set train_micro_batch_size_per_gpu=16 --set zero_optimization.stage=2 --run-dir "$O/$who-2r-z2" --json > "$O/$who-2r-z2.out" 2> "$O/$who-2r-z2.err"
done
for run in 1r 2r 2r-z2; do
  a=$(hash "$O/A-$run.out"); b=$(hash "$O/B-$run.out")
  if [ -n "$a" ] && [ "$a" = "$b" ]; then echo "same weights $run: $a"; else echo "DIFFER $run: A $a B $b"; tail -3 "$O/B-$run.err"; fi
done
