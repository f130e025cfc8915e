#!/usr/bin/env bash
# Data-parallel throughput on one GPU against PyTorch DDP in the same call: 2 ranks share GPU 0,
# each its own NCCL "node" (vitscale: `launch --one-gpu`; DDP: the peer script under hostid.sh),
# so NCCL connects them through its Socket transport on loopback — an emulated slow network,
# never a figure for NVLink. Writes one JSON line per point to OUT/vitscale.jsonl and
# OUT/ddp.jsonl and prints the table.
#
#   scripts/gpu_dp_bench.sh [BIN] [OUT] [PEERS_DIR] [SET]
#   SET: b16 (ViT-B/16 224 px, micro 16/64/256 × GAS 1/4), s4 (ViT-S/4 32 px, micro 128/512), or all
set -u
BIN=$(realpath "${1:-target/release/vitscale}")
OUT=$(realpath -m "${2:-gpu-dp-bench}")
PEERS=$(realpath "${3:-peers}")
SET=${4:-all}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}

vs() { # model micro gas dtype [extra bench flags]
  local model=$1 micro=$2 gas=$3 dtype=$4; shift 4
  local log="$OUT/vs_${model}_${micro}_${gas}_${dtype}${1:+_graph_on}.log"
  "$BIN" launch --nproc-per-node 2 --one-gpu --master-port $((29500 + RANDOM % 2000)) -- bench --device cuda --model "$model" --classes 10 \
    --micro "$micro" --gas "$gas" --comm-dtype "$dtype" --steps "$STEPS" --warmup "$WARMUP" --no-ceiling --json "$@" > "$log" 2>&1
  tail -1 "$log" | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['model']='$model'; print(json.dumps(r))" >> "$OUT/vitscale.jsonl" \
    || { echo "vitscale $model micro $micro GAS $gas $dtype failed:"; tail -5 "$log"; }
}
ddp() { # micros gas [peer flags]
  local micros=$1 gas=$2; shift 2
  (cd "$PEERS" && torchrun --nproc-per-node 2 --master-port $((27500 + RANDOM % 1000)) --no-python ./hostid.sh python3 vit_bench.py --mode ddp --one-gpu \
      --micro "$micros" --gas "$gas" --steps "$STEPS" --warmup "$WARMUP" "$@" 2>>"$OUT/ddp.err" | grep '^{' >> "$OUT/ddp.jsonl") \
    || echo "DDP $micros GAS $gas failed (see $OUT/ddp.err)"
}

if [ "$SET" = b16 ] || [ "$SET" = all ]; then
  ddp 16,64,256 1,4
  for m in 16 64 256; do for g in 1 4; do vs vit_base_patch16_224 $m $g fp32; done; done
  for m in 16 64; do for g in 1 4; do vs vit_base_patch16_224 $m $g bf16; done; done
  # micro 16 is launch-bound: every micro-batch a CUDA graph (buckets reduced after the backward)
  for g in 1 4; do vs vit_base_patch16_224 16 $g fp32 --graph on; done
fi
if [ "$SET" = s4 ] || [ "$SET" = all ]; then
  ddp 128,512 1 --model vit_small_patch16_224 --img 32 --patch 4
  for m in 128 512; do for d in fp32 bf16; do vs vit_small_patch4_32 $m 1 $d; done; done
fi

python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
ddp = {}
for r in load("ddp.jsonl"):
    key = ("vit_small_patch4_32" if r["img"] == 32 else r["model"], r["micro"], r["gas"])
    ddp[key] = r["img_per_s"]
print("| model | micro | GAS | wire | graph | vitscale img/s | DDP img/s | ratio | one rank alone | exposed comm ms (share) | all-reduce alone ms | backward alone ms | overlap target |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in load("vitscale.jsonl"):
    d = ddp.get((r["model"], r["micro"], r["gas"]))
    ratio = f"{r['global_img_per_s'] / d:.2f}" if d else "–"
    print(f"| {r['model']} | {r['micro']} | {r['gas']} | {r['wire']} | {r['graph']} | {r['global_img_per_s']:.0f} | {d if d else '–'} | {ratio} | {r['one_rank_img_per_s']:.0f} | "
          f"{r['exposed_ms']:.1f} ({100 * r['exposed_share']:.0f} %) | {r['allreduce_alone_ms']:.1f} | {r['backward_alone_ms']:.1f} | "
          f"{'met' if r['overlap_met'] else 'missed'} ({r['overlap_target_ms']:.1f}) |")
PY
