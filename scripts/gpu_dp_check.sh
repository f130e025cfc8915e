#!/usr/bin/env bash
# Data parallelism over NCCL on one GPU: every rank on GPU 0 as its own NCCL "node"
# (`vitscale launch --one-gpu`, NCCL's Socket transport over loopback: a slow emulated network,
# never a figure for NVLink). Checks, on the GPU machine:
#   1. N ranks == 1 rank with the same global batch (2 ranks at GAS 1 and GAS 4, 4 ranks at
#      GAS 1): per-step training loss within 2e-2 relative (bf16 compute, different splits of
#      the batch), final validation loss within 2e-2;
#      also with a bf16 gradient wire (communication_data_type), and 2 nodes of one rank each
#      (two launchers, --nnodes 2);
#   2. a SIGKILLed rank and a SIGSTOPped rank each end the job in bounded time; the stall
#      names the rank that never entered the collective;
#   3. the per-rank metrics carry exposed and total communication;
#   4. `selftest` over 2 ranks checks the NCCL communicator.
#
#   scripts/gpu_dp_check.sh [BIN] [OUTDIR]        (SKIP_FAULTS=1: part 1 only)
#   ONE_GPU=0: each rank on its own GPU (a machine with several; the 4-rank check needs 4),
#   NCCL picks its transports itself (NVLink on one host) — issue 30's real multi-GPU round.
set -u
BIN=${1:-target/release/vitscale}
OUT=${2:-gpu-dp}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
fail=0
og=(--one-gpu)
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); [ "${NGPU:-0}" -ge 1 ] || NGPU=1
[ "${ONE_GPU:-1}" = 0 ] && og=()
# ranks a check may use: any number on one GPU, one per GPU otherwise
fits() { [ "${#og[@]}" -gt 0 ] || [ "$1" -le "$NGPU" ]; }
common=(--device cuda --json --set train.steps=24 --set train.log_every=1 --set data.train_size=4096 --set data.val_size=512
        --set zero_optimization.reduce_bucket_size=20000)

run1() { "$BIN" train "${common[@]}" "$@"; }
runn() { local n=$1; shift; "$BIN" launch --nproc-per-node "$n" "${og[@]}" --master-port $((29500 + RANDOM % 1000)) -- train "${common[@]}" "$@"; }

compare() { # dirA dirB label
  python3 - "$1" "$2" "$3" <<'EOF'
import json, sys
a, b, label = sys.argv[1:4]
def steps(d):
    return [json.loads(l) for l in open(d + "/metrics.jsonl") if '"kind"' not in l]
def final(d):
    return json.load(open(d + "/summary.json"))
sa, sb = steps(a), steps(b)
la, lb = [r["loss"] for r in sa], [r["loss"] for r in sb]
worst = max(abs(x - y) / abs(x) for x, y in zip(la, lb))
va, vb = final(a)["val_loss"], final(b)["val_loss"]
ok = len(la) == len(lb) and worst < 2e-2 and abs(va - vb) / va < 2e-2
ex = [r.get("comm_s") for r in sb]; tot = [r.get("comm_total_s") for r in sb]; ov = [r.get("comm_overlap") for r in sb]
print(json.dumps({"check": label, "ok": ok, "steps": len(la), "loss_max_rel": worst, "val_loss": [va, vb],
                  "exposed_s_last": ex[-1], "comm_total_s_last": tot[-1], "overlap_last": ov[-1], "bus_gb_s_last": sb[-1].get("bus_gb_s")}))
sys.exit(0 if ok else 1)
EOF
}

echo "== 1. N ranks == 1 rank (one GPU, NCCL_HOSTID per rank)"
run1 --set train_micro_batch_size_per_gpu=64 --set gradient_accumulation_steps=1 --run-dir "$OUT/one_gas1" > "$OUT/one_gas1.log" 2>&1 || { echo "1-rank run failed"; tail -5 "$OUT/one_gas1.log"; fail=1; }
runn 2 --set train_micro_batch_size_per_gpu=32 --set gradient_accumulation_steps=1 --run-dir "$OUT/two_gas1" > "$OUT/two_gas1.log" 2>&1 || { echo "2-rank run failed"; tail -20 "$OUT/two_gas1.log"; fail=1; }
compare "$OUT/one_gas1" "$OUT/two_gas1" "2 ranks GAS 1 vs 1 rank" || fail=1
run1 --set train_micro_batch_size_per_gpu=16 --set gradient_accumulation_steps=4 --run-dir "$OUT/one_gas4" > "$OUT/one_gas4.log" 2>&1 || fail=1
runn 2 --set train_micro_batch_size_per_gpu=8 --set gradient_accumulation_steps=4 --run-dir "$OUT/two_gas4" > "$OUT/two_gas4.log" 2>&1 || { echo "2-rank GAS 4 failed"; tail -20 "$OUT/two_gas4.log"; fail=1; }
compare "$OUT/one_gas4" "$OUT/two_gas4" "2 ranks GAS 4 vs 1 rank" || fail=1
if fits 4; then
  runn 4 --set train_micro_batch_size_per_gpu=16 --set gradient_accumulation_steps=1 --run-dir "$OUT/four_gas1" > "$OUT/four_gas1.log" 2>&1 || { echo "4-rank run failed"; tail -20 "$OUT/four_gas1.log"; fail=1; }
  compare "$OUT/one_gas1" "$OUT/four_gas1" "4 ranks GAS 1 vs 1 rank" || fail=1
fi
runn 2 --set train_micro_batch_size_per_gpu=32 --set gradient_accumulation_steps=1 --set communication_data_type=bf16 --run-dir "$OUT/two_bf16" > "$OUT/two_bf16.log" 2>&1 || { echo "2-rank bf16-wire run failed"; tail -20 "$OUT/two_bf16.log"; fail=1; }
compare "$OUT/one_gas1" "$OUT/two_bf16" "2 ranks GAS 1, bf16 wire vs 1 rank" || fail=1
port=$((31200 + RANDOM % 500))
for node in 0 1; do
  "$BIN" launch --nnodes 2 --node-rank $node --nproc-per-node 1 --one-gpu --master-addr 127.0.0.1 --master-port $port -- train "${common[@]}" \
    --set train_micro_batch_size_per_gpu=32 --set gradient_accumulation_steps=1 --run-dir "$OUT/two_nodes" > "$OUT/two_nodes_$node.log" 2>&1 &
done
wait || { echo "2-node run failed"; tail -20 "$OUT"/two_nodes_*.log; fail=1; }
compare "$OUT/one_gas1" "$OUT/two_nodes" "2 nodes x 1 rank vs 1 rank" || fail=1

echo "== 4. selftest over 2 ranks (the NCCL communicator)"
"$BIN" launch --nproc-per-node 2 "${og[@]}" --master-port $((31800 + RANDOM % 500)) -- selftest --device cuda > "$OUT/selftest2.log" 2>&1 || { echo "selftest over 2 ranks failed"; fail=1; }
grep -E "^  (ok  |FAIL) comm |^  FAIL|failed checks|checks, " "$OUT/selftest2.log"

[ "${SKIP_FAULTS:-0}" = 1 ] && exit $fail
echo "== 2. faults: a killed rank, a stopped rank"
long=(--set train.steps=100000 --set train.comm_timeout_s=15 --set train_micro_batch_size_per_gpu=32)
for sig in KILL STOP; do
  "$BIN" launch --nproc-per-node 2 "${og[@]}" --master-port $((30600 + RANDOM % 500)) -- train "${common[@]}" "${long[@]}" --run-dir "$OUT/fault_$sig" > "$OUT/fault_$sig.log" 2>&1 &
  lpid=$!
  # wait for rank 1 to train (its metrics file grows), then signal it
  for _ in $(seq 1 120); do [ -s "$OUT/fault_$sig/rank1/metrics.jsonl" ] && break; sleep 0.5; done
  victim=$(pgrep -f "fault_$sig" | while read -r p; do tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx RANK=1 && echo "$p"; done | head -1)
  t0=$(date +%s.%N)
  kill -s "$sig" "$victim"
  ended=no
  for _ in $(seq 1 120); do kill -0 "$lpid" 2>/dev/null || { ended=yes; break; }; sleep 0.5; done
  t1=$(date +%s.%N)
  secs=$(python3 -c "print(round($t1 - $t0, 1))")
  [ "$sig" = STOP ] && kill -CONT "$victim" 2>/dev/null
  [ "$ended" = yes ] || { kill -9 "$lpid" 2>/dev/null; pkill -9 -f "fault_$sig"; }
  named=$(grep -m3 -iE "rank [0-9]" "$OUT/fault_$sig.log" | tr '\n' ' ' | cut -c1-400)
  echo "{\"check\": \"SIG$sig rank 1\", \"ended\": \"$ended\", \"seconds\": $secs, \"log\": \"${named//\"/\'}\"}"
  [ "$ended" = yes ] || fail=1
  if [ "$sig" = STOP ]; then
    grep -m2 -E "never entered|did not complete|timed out" "$OUT/fault_$sig.log"
    grep -qE "rank 1 (never entered|issued nothing|went silent)|waiting for rank 1|\[1\]" "$OUT/fault_$sig.log" || { echo "the stall does not name rank 1"; fail=1; }
  fi
done
exit $fail
