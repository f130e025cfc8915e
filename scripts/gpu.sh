#!/usr/bin/env bash
# One round on a GPU machine: backend parity selftest, vitscale benchmarks and the PyTorch peer
# in the same run, then a side-by-side table.
#
#   scripts/gpu.sh [BIN] [PEER_SCRIPT] [OUTDIR] [quick]
#
# BIN defaults to target/release/vitscale, PEER_SCRIPT to peers/vit_bench.py, OUTDIR to
# gpu-results. "quick" skips the torch.compile peer. The binary finds the CUDA libraries itself
# (pip wheels under site-packages/nvidia/*, /usr/local/cuda*); VITSCALE_CUDA_LIB_DIR overrides.
set -u
BIN=${1:-target/release/vitscale}
PEER=${2:-peers/vit_bench.py}
OUT=${3:-gpu-results}
MODE=${4:-full}
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)

# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

{
  date -u +"date: %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | sed 's/^/card: /'
  python3 -c 'import torch, timm; print("peer: torch", torch.__version__, "timm", timm.__version__)' 2>/dev/null
} | tee "$OUT/env.txt"

echo "== selftest"
"$BIN" selftest --device cuda --json 2>&1 | tee "$OUT/selftest.log"

echo "== vitscale bench"
: > "$OUT/vitscale.jsonl"
run_bench() {
  echo "\$ vitscale bench $*" | tee -a "$OUT/bench.log"
  "$BIN" bench --json "$@" 2>&1 | tee -a "$OUT/bench.log" | tail -n 2
  tail -n 1 "$OUT/bench.log" | grep '^{' >> "$OUT/vitscale.jsonl"
}
run_bench --model vit_base_patch16_224 --classes 10 --micro 256
run_bench --model vit_base_patch16_224 --classes 10 --micro 16 --steps 50
run_bench --model vit_small_patch4_32 --micro 512 --steps 50
run_bench --model vit_base_patch16_224 --classes 10 --micro 16 --steps 50 --graph off --no-ceiling

echo "== peer (PyTorch)"
: > "$OUT/peer.jsonl"
python3 "$PEER" --mode torch --micro 16,256 2>"$OUT/peer.err" | tee -a "$OUT/peer.jsonl"
python3 "$PEER" --mode torch --model vit_small_patch16_224 --img 32 --patch 4 --micro 512 2>>"$OUT/peer.err" | tee -a "$OUT/peer.jsonl"
if [ "$MODE" != quick ]; then
  python3 "$PEER" --mode torch --compile --micro 256 2>>"$OUT/peer.err" | tee -a "$OUT/peer.jsonl"
fi

python3 "$here/bench_table.py" "$OUT" | tee "$OUT/table.md"
