#!/usr/bin/env bash
# A/B of two vitscale binaries on the GPU machine, alternating in one call: selftest of B, then
# `bench` for ViT-B/16 micro 16 and 256 and ViT-S/4 32 px micro 512 with A, B, A, B.
#   scripts/gpu_ab.sh A_BIN B_BIN [OUTDIR]
A=$1; B=$2; O=${3:-gpu-ab}; mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv,noheader | sed 's/^/card: /'
timeout 150 "$B" selftest --device cuda > "$O/selftest.log" 2>&1; echo "selftest (B) rc $?: $(grep -E 'checks' "$O/selftest.log" | tail -1 | cut -c1-160)"
for cfg in "vit_base_patch16_224 16 40" "vit_base_patch16_224 256 20" "vit_small_patch4_32 512 40"; do
  set -- $cfg
  for round in 1 2; do
    for who in A B; do
      bin=${!who}
      line=$(timeout 60 "$bin" bench --model "$1" --micro "$2" --steps "$3" --warmup 5 --no-ceiling --classes 10 2>&1 | grep "ms/step" | sed 's/ | norm\/GELU.*//')
      echo "$who $1 m$2 r$round: ${line#* on }"
    done
  done
done
