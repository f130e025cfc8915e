#!/usr/bin/env bash
# One device round: selftest, vitscale bench for ViT-B/16 micro 256 and ViT-S/4 32 px micro 512
# (each with a profile of one eager step), micro 16 (activation recompute auto, then never), the
# PyTorch eager peer for the same three, torch.compile at micro 256, then the table (~5 min after
# the machine start; COMPILE=0 skips torch.compile). BIN, PEER and OUT from the environment.
here=$(cd "$(dirname "$0")" && pwd)
BIN=${BIN:-target/release/vitscale}; PEER=${PEER:-peers/vit_bench.py}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
O=${OUT:-out}; mkdir -p "$O"
{ date -u +"date: %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | sed 's/^/card: /'
  python3 -c 'import torch, timm; print("peer: torch", torch.__version__, "timm", timm.__version__)' 2>/dev/null; } | tee "$O/env.txt"
t0=$SECONDS
timeout 120 "$BIN" selftest --device cuda > "$O/selftest.log" 2>&1; echo "selftest rc $? ($((SECONDS-t0)) s)"
grep -E "FAIL|checks,|layernorm|bias|gelu|add " "$O/selftest.log" | sed 's/  */ /g' | cut -c1-120 | head -30
: > "$O/vitscale.jsonl"
b() { local to=$1 tag=$2; shift 2
  timeout $to "$BIN" bench --json "$@" > "$O/b_$tag.log" 2>&1; local rc=$?
  echo "== $tag rc $rc ($((SECONDS-t0)) s): $(grep -E 'ms/step' "$O/b_$tag.log" | sed 's/.*micro/micro/')"
  grep -E '^GPU during' "$O/b_$tag.log" | sed 's/^/   /'
  [ $rc -ne 0 ] && tail -3 "$O/b_$tag.log" | cut -c1-300
  tail -n 1 "$O/b_$tag.log" | grep '^{' >> "$O/vitscale.jsonl"; }
b 40 b16_256 --model vit_base_patch16_224 --classes 10 --micro 256 --steps 20 --profile
grep -E "profile of|layernorm|gelu|bias_grad|add_|reduce_partials" "$O/b_b16_256.log" | head -14
b 25 b16_16 --model vit_base_patch16_224 --classes 10 --micro 16 --steps 50 --no-ceiling
b 25 b16_16_keep --model vit_base_patch16_224 --classes 10 --micro 16 --steps 50 --no-ceiling --recompute never
b 30 s4_512 --model vit_small_patch4_32 --micro 512 --steps 50 --no-ceiling --profile
grep -E "profile of" -A12 "$O/b_s4_512.log" | head -13
: > "$O/peer.jsonl"
timeout 45 python3 "$PEER" --mode torch --micro 16,256 2>/tmp/peer.err | tee -a "$O/peer.jsonl" | cut -c1-200; echo "peer rc $? ($((SECONDS-t0)) s)"
timeout 25 python3 "$PEER" --mode torch --model vit_small_patch16_224 --img 32 --patch 4 --micro 512 2>>/tmp/peer.err | tee -a "$O/peer.jsonl" | cut -c1-200; echo "peer cifar rc $? ($((SECONDS-t0)) s)"
if [ "${COMPILE:-1}" != 0 ]; then
  timeout 240 python3 "$PEER" --mode torch --compile --micro 256 2>>/tmp/peer.err | tee -a "$O/peer.jsonl" | cut -c1-200; echo "peer compile rc $? ($((SECONDS-t0)) s)"
fi
tail -3 /tmp/peer.err | cut -c1-300
python3 "$here/bench_table.py" "$O" | tee "$O/table.md"
