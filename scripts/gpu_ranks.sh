# Sourced by the GPU rank checks (gpu_zero_check.sh, gpu_zero3_check.sh, gpu_sp_check.sh) after
# they set BIN: NCCL without NVLink multicast (ranks share one GPU), a random launch port, one
# training run on one process or on ranks sharing the GPU, and the comparison of two runs.

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPU_RANKS_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

port() { echo $((29500 + RANDOM % 2000)); }

# train_ranks NPROC DIR ARGS...: `vitscale train ARGS` in one process (NPROC 1) or on NPROC ranks
# sharing the GPU (`launch --one-gpu`), its run in DIR, its weights in DIR/w.safetensors, its
# output in DIR.log. On failure: a JSON line with the log's tail, status 1.
train_ranks() {
  local n=$1 d=$2; shift 2
  if [ "$n" = 1 ]; then
    "$BIN" train "$@" --run-dir "$d" --save-weights "$d/w.safetensors" > "$d.log" 2>&1
  else
    "$BIN" launch --nproc-per-node "$n" --one-gpu --master-port "$(port)" -- train "$@" \
      --run-dir "$d" --save-weights "$d/w.safetensors" > "$d.log" 2>&1
  fi || { echo "{\"check\": \"run $d\", \"ok\": false, \"log_tail\": $(tail -5 "$d.log" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')}"; return 1; }
}

# compare_runs DIR_A DIR_B LABEL LOSS_TOL WEIGHT_TOL WORLD: compare_runs.py's JSON line; status 1
# on a miss.
compare_runs() { python3 "$GPU_RANKS_HERE/compare_runs.py" "$@"; }
