#!/usr/bin/env bash
# Real multi-GPU round (issue 30): every rank on its own GPU of one host, NCCL choosing its
# transports (NVLink), no NCCL_HOSTID. One part per call fits the device tool's 10 minutes:
#   PART=check  the N ranks == 1 rank checks, a killed and a stopped rank, selftest over 2 ranks
#               (scripts/gpu_dp_check.sh with ONE_GPU=0);
#   PART=bench  vitscale against DDP, DDP + torch.compile and DeepSpeed ZeRO 0/1/2 on all GPUs,
#               ViT-B/16 micro 16/64/128/256 × GAS 1/4 and ViT-S/4 micro 128/512
#               (scripts/gpu_dp_bench.sh with ONE_GPU=0 NPROC=<GPUs>); efficiency is against
#               the data-parallel bench's one-rank-alone phase in the same call;
#   PART=zero   vitscale ZeRO 0/1/2 against DeepSpeed's on all GPUs (scripts/gpu_zero_bench.sh);
#   PART=lab    bench --comm at 2..N ranks and the study's batch-size sweep at 1..N ranks, with
#               its report.
#
#   PART=check|bench|zero|lab scripts/gpu_multi.sh [BIN] [OUT] [PEERS] [WHEELS]
set -u
BIN=$(realpath "${1:-target/release/vitscale}")
OUT=$(realpath -m "${2:-gpu-multi}")
PEERS=$(realpath "${3:-peers}")
WHL=$(realpath -m "${4:-.whl}")
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "${NGPU:-0}" -ge 2 ] || { echo "gpu_multi.sh: $NGPU GPU(s) here; this round needs 2 or more"; exit 2; }
here=$(dirname "$0")
case "${PART:-check}" in
  check) ONE_GPU=0 bash "$here/gpu_dp_check.sh" "$BIN" "$OUT/check" ;;
  bench) ONE_GPU=0 NPROC=$NGPU MODES="ddp ddp+compile ds0 ds1 ds2" WHEELS=$WHL bash "$here/gpu_dp_bench.sh" "$BIN" "$OUT/bench" "$PEERS" all ;;
  zero) ONE_GPU=0 NPROC=$NGPU bash "$here/gpu_zero_bench.sh" "$BIN" "$OUT/zero" "$PEERS" "$WHL" ;;
  lab)
    for n in $(seq 2 "$NGPU"); do
      "$BIN" launch --nproc-per-node "$n" -- bench --comm --device cuda --comm-max-bytes 268435456 --comm-iters 20 --warmup 5 > "$OUT/comm_$n.txt" 2>&1
    done
    # the study's spec at the rank counts this host has (its base made absolute)
    python3 - "$NGPU" "$OUT/batch_size_spec.json" <<'PY'
import json, os, sys
n, out = int(sys.argv[1]), sys.argv[2]
src = "configs/study/batch_size_cifar10.json"
spec = json.load(open(src))
if isinstance(spec.get("base"), str):
    spec["base"] = os.path.abspath(os.path.join(os.path.dirname(src), spec["base"]))
spec["grid"]["nproc"] = [k for k in (1, 2, 4, 8) if k <= n]
json.dump(spec, open(out, "w"), indent=1)
PY
    "$BIN" sweep "$OUT/batch_size_spec.json" --out "$OUT/batch_size" --device cuda --set data.dataset=synthetic --set data.path=null \
      --set data.train_size=50000 --set data.val_size=2000 --report > "$OUT/sweep.txt" 2>&1
    tail -5 "$OUT/sweep.txt" ;;
  *) echo "gpu_multi.sh: PART must be check, bench, zero or lab"; exit 2 ;;
esac
