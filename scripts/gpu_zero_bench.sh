#!/usr/bin/env bash
# ZeRO throughput and memory on one GPU against DeepSpeed ZeRO in the same call: 2 ranks share
# GPU 0, each its own NCCL "node" (vitscale: `launch --one-gpu`; DeepSpeed: the peer script under
# hostid.sh), so NCCL connects them through its Socket transport on loopback, an emulated slow
# network (never a figure for NVLink). ViT-B/16 224 px, micro 64, GAS 1 and 4, stages 0/1/2.
# DeepSpeed runs bf16 with its default communication_data_type (bf16 gradients), so vitscale
# runs a bf16 gradient wire too; its stage 0 also runs fp32 for the stage-2-vs-stage-0 target.
# Needs the DeepSpeed wheels (peers/get-wheels.sh WHL) built on a machine with the registry.
# Writes OUT/vitscale.jsonl and OUT/deepspeed.jsonl and prints the table.
#
#   scripts/gpu_zero_bench.sh [BIN] [OUT] [PEERS_DIR] [WHEELS_DIR]
#   ONE_GPU=0 NPROC=N: each of N ranks on its own GPU instead (no NCCL_HOSTID).
set -u
BIN=$(realpath "${1:-target/release/vitscale}")
OUT=$(realpath -m "${2:-gpu-zero-bench}")
PEERS=$(realpath "${3:-peers}")
WHL=$(realpath "${4:-.whl}")
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
MICRO=${MICRO:-64}
NPROC=${NPROC:-2}
og=(--one-gpu)
peer_run=(--no-python ./hostid.sh python3 vit_bench.py --one-gpu)
if [ "${ONE_GPU:-1}" = 0 ]; then
  og=()
  peer_run=(vit_bench.py)
fi

vs() { # stage gas dtype
  local s=$1 gas=$2 dtype=$3
  local log="$OUT/vs_z${s}_gas${gas}_${dtype}.log"
  "$BIN" launch --nproc-per-node "$NPROC" "${og[@]}" --master-port $((29500 + RANDOM % 2000)) -- bench --device cuda --model vit_base_patch16_224 --classes 10 \
    --micro "$MICRO" --gas "$gas" --zero "$s" --comm-dtype "$dtype" --steps "$STEPS" --warmup "$WARMUP" --no-ceiling --json > "$log" 2>&1
  tail -1 "$log" | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print(json.dumps(r))" >> "$OUT/vitscale.jsonl" \
    || { echo "vitscale stage $s GAS $gas $dtype failed:"; tail -5 "$log"; }
}
ds() { # stage
  (cd "$PEERS" && TORCH_CUDA_ARCH_LIST=9.0 torchrun --nproc-per-node "$NPROC" --master-port $((27500 + RANDOM % 1000)) "${peer_run[@]}" \
      --mode deepspeed --zero "$1" --micro "$MICRO" --gas 1,4 --steps "$STEPS" --warmup "$WARMUP" 2>>"$OUT/deepspeed.err" | grep '^{' >> "$OUT/deepspeed.jsonl") \
    || echo "DeepSpeed stage $1 failed (see $OUT/deepspeed.err)"
}

if python3 -m pip install -q --no-index --no-deps --target /tmp/ds-site "$WHL"/*.whl > "$OUT/pip.log" 2>&1; then
  export PYTHONPATH=/tmp/ds-site${PYTHONPATH:+:$PYTHONPATH}
  for s in 0 1 2; do ds "$s"; done
else
  echo "no DeepSpeed (wheels did not install: $OUT/pip.log)"
fi
for s in 0 1 2; do for g in 1 4; do vs "$s" "$g" bf16; done; done
for s in 0 2; do for g in 1 4; do vs "$s" "$g" fp32; done; done

python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
ds = {(int(r["mode"].split("+z")[1]), r["gas"]): r for r in load("deepspeed.jsonl")}
vs = load("vitscale.jsonl")
print("| stage | GAS | wire | vitscale img/s | DeepSpeed img/s | ratio | vitscale peak GiB/rank | DeepSpeed peak GiB/rank | exposed comm ms (share) |")
print("|---|---|---|---|---|---|---|---|---|")
for r in vs:
    d = ds.get((r["zero_stage"], r["gas"])) if r["wire"] == "bf16" else None
    ratio = f"{r['global_img_per_s'] / d['img_per_s']:.2f}" if d else "–"
    pk = f"{r['peak_mem_gib']:.2f}" if r.get("peak_mem_gib") is not None else "–"
    print(f"| {r['zero_stage']} | {r['gas']} | {r['wire']} | {r['global_img_per_s']:.0f} | {d['img_per_s'] if d else '–'} | {ratio} | {pk} | "
          f"{d['max_mem_gib'] if d else '–'} | {r['exposed_ms']:.1f} ({100 * r['exposed_share']:.0f} %) |")
by = {(r["zero_stage"], r["gas"], r["wire"]): r["global_img_per_s"] for r in vs}
for (s, g, w), v in sorted(by.items()):
    if s == 2 and (0, g, w) in by:
        print(f"stage 2 / stage 0, GAS {g}, {w} wire: {v / by[(0, g, w)]:.3f} (target >= 0.98)")
PY
