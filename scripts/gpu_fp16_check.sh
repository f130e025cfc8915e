#!/usr/bin/env bash
# fp16 compute on the GPU (docs/precision.md), on one GPU of Ampere or newer:
#  1. selftest at the native architecture in both formats (bf16 and fp16 passes), and with
#     VITSCALE_CUDA_ARCH=sm_75, where a run without a precision block computes in fp16;
#  2. 30-step training runs against the CPU: an fp16 block natively and under sm_75, sm_75
#     without a block (fp16 and the default scaler, chosen with a notice), and bf16 natively as
#     the baseline for how far a 16-bit run lands from the CPU's f32.
# One JSON line per selftest and per run on stdout, then PASS or FAIL; logs in OUTDIR.
# A run passes when its final train_loss is within 5 % of the CPU's with the same block (the
# CPU computes in f32 and scales the loss alike) and nothing failed.
#
#   scripts/gpu_fp16_check.sh [BIN] [OUTDIR]
set -u
BIN=${1:-target/release/vitscale}
OUT=${2:-gpu-fp16}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FP16='fp16={"enabled": true}'
SHORT=(--set train.steps=30 --set data.train_size=1920 --json)
fail=0

selftest() {  # name, env assignment or "", selftest args...
  local name=$1 envset=$2; shift 2
  env $envset "$BIN" selftest --device cuda "$@" > "$OUT/selftest_$name.log" 2>&1; local st=$?
  [ "$st" = 0 ] || fail=1
  echo "{\"selftest\": \"$name\", \"exit\": $st, \"passes\": $(grep -c '^selftest on' "$OUT/selftest_$name.log"), \"failed_checks\": $(grep -c '^  FAIL' "$OUT/selftest_$name.log"), \"formats\": \"$(grep '^compute format' "$OUT/selftest_$name.log" | awk '{print $3}' | tr '\n' ' ')\"}"
}
selftest native "" --seed 1
selftest sm_75 "VITSCALE_CUDA_ARCH=sm_75" --seed 1

train() {  # name, device, env assignment or "", extra args...
  local name=$1 dev=$2 envset=$3; shift 3
  env $envset "$BIN" train --device "$dev" "${SHORT[@]}" --run-dir "$OUT/train_$name" "$@" > "$OUT/train_$name.json" 2> "$OUT/train_$name.err"; local rc=$?
  [ "$rc" = 0 ] || fail=1
}
train cpu_fp16 cpu "" --set "$FP16"
train cpu_none cpu ""
train native_fp16 cuda "" --set "$FP16"
train native_bf16 cuda "" --set 'bf16={"enabled": true}'
train sm75_fp16 cuda "VITSCALE_CUDA_ARCH=sm_75" --set "$FP16"
train sm75_none cuda "VITSCALE_CUDA_ARCH=sm_75"
grep -h "^notice" "$OUT/train_sm75_none.err" | head -n 1

python3 - "$OUT" <<'PY' || fail=1
import json, sys
o = sys.argv[1]
def last(name):
    return json.loads([l for l in open(f"{o}/train_{name}.json") if l.startswith("{")][-1])
bad = 0
for name, ref in [("native_fp16", "cpu_fp16"), ("native_bf16", "cpu_none"), ("sm75_fp16", "cpu_fp16"), ("sm75_none", "cpu_fp16")]:
    try:
        g, c = last(name), last(ref)
        rel = abs(g["train_loss"] - c["train_loss"]) / abs(c["train_loss"])
        ok = rel <= 0.05
        print(json.dumps({"run": name, "cpu": ref, "train_loss": g["train_loss"], "cpu_train_loss": c["train_loss"], "rel_diff": round(rel, 4),
                          "val_top1": g["val_top1"], "cpu_val_top1": c["val_top1"], "loss_scale": g.get("loss_scale"), "skipped_steps": g.get("skipped_steps"), "pass": ok}))
        bad += not ok
    except Exception as e:
        print(json.dumps({"run": name, "error": str(e)}))
        bad += 1
# an fp16 run logs its scaler; the implicit one must too (DeepSpeed's default dynamic scaler)
for name in ["native_fp16", "sm75_fp16", "sm75_none"]:
    try:
        if last(name).get("loss_scale") is None:
            print(json.dumps({"run": name, "error": "no loss_scale in the summary"})); bad += 1
    except Exception:
        pass
sys.exit(1 if bad else 0)
PY
[ "$fail" = 0 ] && echo PASS || echo FAIL
exit $fail
