#!/usr/bin/env bash
# Data-parallel throughput against PyTorch DDP (and, with MODES, DDP + torch.compile and
# DeepSpeed ZeRO 0/1/2) in the same call. By default 2 ranks share GPU 0, each its own NCCL
# "node" (vitscale: `launch --one-gpu`; peers: the peer script under hostid.sh), so NCCL
# connects them through its Socket transport on loopback — an emulated slow network, never a
# figure for NVLink. ONE_GPU=0 NPROC=N puts each of N ranks on its own GPU instead (a machine
# with N GPUs; NCCL picks NVLink). Writes one JSON line per point to OUT/vitscale.jsonl and
# OUT/peers.jsonl and prints the table.
#
#   scripts/gpu_dp_bench.sh [BIN] [OUT] [PEERS_DIR] [SET]
#   SET: b16 (ViT-B/16 224 px, micro 16/64/256 × GAS 1/4; 128 too with ONE_GPU=0), s4 (ViT-S/4
#        32 px, micro 128/512), or all
#   MODES: peer modes, space-separated, of ddp, ddp+compile, ds0, ds1, ds2 (default: ddp);
#          DeepSpeed needs its wheels installed (WHEELS=DIR from peers/get-wheels.sh)
set -u
BIN=$(realpath "${1:-target/release/vitscale}")
OUT=$(realpath -m "${2:-gpu-dp-bench}")
PEERS=$(realpath "${3:-peers}")
SET=${4:-all}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
NPROC=${NPROC:-2}
MODES=${MODES:-ddp}
og=(--one-gpu)
peer_run=(--no-python ./hostid.sh python3 vit_bench.py --one-gpu)
if [ "${ONE_GPU:-1}" = 0 ]; then
  og=()
  peer_run=(vit_bench.py)
fi
if [ -n "${WHEELS:-}" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/ds-site "$WHEELS"/*.whl > "$OUT/pip.log" 2>&1; then
  export PYTHONPATH=/tmp/ds-site${PYTHONPATH:+:$PYTHONPATH}
fi

vs() { # model micro gas dtype [extra bench flags]
  local model=$1 micro=$2 gas=$3 dtype=$4; shift 4
  local log="$OUT/vs_${model}_${micro}_${gas}_${dtype}${1:+_graph_on}.log"
  "$BIN" launch --nproc-per-node "$NPROC" "${og[@]}" --master-port $((29500 + RANDOM % 2000)) -- bench --device cuda --model "$model" --classes 10 \
    --micro "$micro" --gas "$gas" --comm-dtype "$dtype" --steps "$STEPS" --warmup "$WARMUP" --no-ceiling --json "$@" > "$log" 2>&1
  tail -1 "$log" | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['model']='$model'; print(json.dumps(r))" >> "$OUT/vitscale.jsonl" \
    || { echo "vitscale $model micro $micro GAS $gas $dtype failed:"; tail -5 "$log"; }
}
peer() { # micros gas [peer flags]: every mode of MODES
  local micros=$1 gas=$2; shift 2
  for mode in $MODES; do
    local flags=()
    case "$mode" in
      ddp) flags=(--mode ddp) ;;
      ddp+compile) flags=(--mode ddp --compile) ;;
      ds0|ds1|ds2) flags=(--mode deepspeed --zero "${mode#ds}") ;;
      *) echo "unknown peer mode $mode"; continue ;;
    esac
    (cd "$PEERS" && TORCH_CUDA_ARCH_LIST=9.0 torchrun --nproc-per-node "$NPROC" --master-port $((27500 + RANDOM % 1000)) "${peer_run[@]}" "${flags[@]}" \
        --micro "$micros" --gas "$gas" --steps "$STEPS" --warmup "$WARMUP" "$@" 2>>"$OUT/peers.err" | grep '^{' >> "$OUT/peers.jsonl") \
      || echo "peer $mode $micros GAS $gas failed (see $OUT/peers.err)"
  done
}

if [ "$SET" = b16 ] || [ "$SET" = all ]; then
  B16=${B16_MICROS:-16 64 256}
  [ "${ONE_GPU:-1}" = 0 ] && B16=${B16_MICROS:-16 64 128 256}
  peer "$(echo $B16 | tr ' ' ,)" 1,4
  for m in $B16; do for g in 1 4; do vs vit_base_patch16_224 $m $g fp32; done; done
  for m in 16 64; do for g in 1 4; do vs vit_base_patch16_224 $m $g bf16; done; done
  # micro 16 is launch-bound: every micro-batch a CUDA graph (buckets reduced after the backward)
  for g in 1 4; do vs vit_base_patch16_224 16 $g fp32 --graph on; done
fi
if [ "$SET" = s4 ] || [ "$SET" = all ]; then
  peer 128,512 1 --model vit_small_patch16_224 --img 32 --patch 4
  for m in 128 512; do for d in fp32 bf16; do vs vit_small_patch4_32 $m 1 $d; done; done
fi

python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
peers = {}
for r in load("peers.jsonl"):
    key = ("vit_small_patch4_32" if r["img"] == 32 else r["model"], r["micro"], r["gas"])
    peers.setdefault(key, {})[r["mode"]] = r
modes = sorted({m for v in peers.values() for m in v})
head = ["model", "micro", "GAS", "wire", "graph", "vitscale img/s", "per rank", "one rank alone", "efficiency"] + [f"{m} img/s (ratio)" for m in modes] + ["exposed comm ms (share)", "peak GiB/rank", "overlap target"]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for r in load("vitscale.jsonl"):
    p = peers.get((r["model"], r["micro"], r["gas"]), {})
    cells = [r["model"], str(r["micro"]), str(r["gas"]), r["wire"], r["graph"], f"{r['global_img_per_s']:.0f}", f"{r['per_rank_img_per_s']:.0f}",
             f"{r['one_rank_img_per_s']:.0f}", f"{100 * r['efficiency']:.1f} %"]
    for m in modes:
        q = p.get(m)
        cells.append(f"{q['img_per_s']:.0f} ({r['global_img_per_s'] / q['img_per_s']:.2f}, {q['max_mem_gib']} GiB)" if q else "–")
    pk = r.get("peak_mem_gib")
    cells += [f"{r['exposed_ms']:.1f} ({100 * r['exposed_share']:.1f} %)", f"{pk:.2f}" if pk is not None else "–",
              f"{'met' if r['overlap_met'] else 'missed'} ({r['overlap_target_ms']:.1f})"]
    print("| " + " | ".join(cells) + " |")
PY
