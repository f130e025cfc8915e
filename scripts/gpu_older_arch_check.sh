#!/usr/bin/env bash
# The CUDA kernels built for older architectures on this GPU (VITSCALE_CUDA_ARCH: PTX for the
# older target, JIT-compiled at load): selftest and a 30-step training run against the CPU
# for each, then what each target could not load (optional modules, their paths fell back).
# Under sm_75 both compute in fp16 (no bf16 before Ampere: docs/precision.md); the fp16 block
# natively and the CPU comparison with the same block are in scripts/gpu_fp16_check.sh.
# One line per target on stdout; logs in OUT.
#
#   scripts/gpu_older_arch_check.sh [BIN] [OUTDIR]
set -u
BIN=${1:-target/release/vitscale}
OUT=${2:-gpu-older-arch}
mkdir -p "$OUT"
fail=0
for arch in sm_80 sm_75; do
  export VITSCALE_CUDA_ARCH=$arch
  "$BIN" selftest --device cuda > "$OUT/selftest_$arch.log" 2>&1; st=$?
  "$BIN" train --device cuda --set train.steps=30 --set data.train_size=1920 --json --run-dir "$OUT/train_$arch" > "$OUT/train_$arch.json" 2> "$OUT/train_$arch.err"; tr=$?
  unset VITSCALE_CUDA_ARCH
  echo "{\"arch\": \"$arch\", \"selftest_exit\": $st, \"train_exit\": $tr, \"device\": $(grep -m1 'selftest on' "$OUT/selftest_$arch.log" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().strip()))'), \"failed_checks\": $(grep -c FAIL "$OUT/selftest_$arch.log")}"
  [ "$st" = 0 ] && [ "$tr" = 0 ] || fail=1
done
"$BIN" train --device cpu --set train.steps=30 --set data.train_size=1920 --json --run-dir "$OUT/train_cpu" > "$OUT/train_cpu.json" 2>/dev/null
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
def last(p):
    return json.loads([l for l in open(p) if l.startswith("{")][-1])
cpu = last(f"{o}/train_cpu.json")
for arch in ["sm_80", "sm_75"]:
    try:
        g = last(f"{o}/train_{arch}.json")
        print(json.dumps({"arch": arch, "train_loss": g["train_loss"], "cpu_train_loss": cpu["train_loss"], "val_top1": g["val_top1"], "cpu_val_top1": cpu["val_top1"]}))
    except Exception as e:
        print(json.dumps({"arch": arch, "error": str(e)}))
PY
exit $fail
