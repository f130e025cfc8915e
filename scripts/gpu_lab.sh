#!/usr/bin/env bash
# The scaling lab on one H200 (every rank on GPU 0 as its own NCCL "node": `launch --one-gpu`,
# NCCL's Socket transport over loopback, a slow emulated network, never a figure for NVLink):
#   1. `bench --comm` over NCCL at 2 and 4 ranks (all-reduce, reduce-scatter, all-gather,
#      8 KiB .. 256 MiB): every row must have #wrong 0;
#   2. the study's batch-size sweep (configs/study/batch_size_cifar10.json: ViT-Ti/4 32 px,
#      micro 16..256 at 1, 2, 4 ranks, 60 steps each) with --device cuda, then its report;
#   3. a summary: points ok / failed, the findings with their verdicts, throughput per point.
#
#   scripts/gpu_lab.sh [BIN] [OUTDIR] [CIFAR10_DIR]
#
# Without CIFAR10_DIR (the GPU machine has no dataset) the sweep trains on synthetic 32-px
# images of the same shape and class count: the same model, batches and communication, a
# different (in-memory) loader. Exit status 0 when every point ran and every collective
# checked out.
set -u
BIN=${1:-target/release/vitscale}
OUT=${2:-gpu-lab}
DATA=${3:-}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
fail=0

echo "== 1. bench --comm over NCCL (one GPU)"
for n in 2 4; do
  "$BIN" launch --one-gpu --nproc-per-node "$n" -- bench --comm --device cuda --comm-max-bytes 268435456 --comm-iters 20 --warmup 5 --json \
    > "$OUT/comm_nccl_${n}.txt" 2> "$OUT/comm_nccl_${n}.err" || { echo "bench --comm at $n ranks failed:"; tail -5 "$OUT/comm_nccl_${n}.err"; fail=1; }
  grep -v '^{' "$OUT/comm_nccl_${n}.txt" | head -40
done

echo "== 2. batch-size sweep, --device cuda, 1/2/4 ranks"
if [ -n "$DATA" ]; then
  data=(--set "data.path=$DATA")
else
  data=(--set data.dataset=synthetic --set data.path=null --set data.train_size=50000 --set data.val_size=2000)
fi
t0=$(date +%s)
"$BIN" sweep configs/study/batch_size_cifar10.json --out "$OUT/batch_size" --device cuda "${data[@]}" --json \
  > "$OUT/sweep.txt" 2> "$OUT/sweep.err" || { echo "sweep failed:"; tail -5 "$OUT/sweep.err"; fail=1; }
echo "sweep wall time: $(( $(date +%s) - t0 )) s"
grep -E " ok:| FAILED:" "$OUT/sweep.err"
"$BIN" report "$OUT/batch_size" --json > "$OUT/report.txt" 2> "$OUT/report.err" || { echo "report failed:"; cat "$OUT/report.err"; fail=1; }
cat "$OUT/report.err"

echo "== 3. summary"
python3 - "$OUT" <<'PY' || fail=1
import json, sys
out = sys.argv[1]
outcome = json.loads(open(f"{out}/sweep.txt").read().strip().splitlines()[-1])
print(f"points {outcome['points']}: {outcome['ok']} ok, {outcome['failed']} failed, {outcome['wall_s']:.0f} s")
for line in open(f"{out}/batch_size/sweep.jsonl"):
    r = json.loads(line)
    f = r.get("figures") or {}
    b = f.get("breakdown", {})
    print(f"{r['id']:<28} {r['status']:<6} {f.get('images_per_s', 0):>10.1f} img/s  step {b.get('step_s', 0)*1e3:7.2f} ms  "
          f"exposed comm {b.get('comm_exposed_s', 0)*1e3:7.2f} ms ({f.get('comm_share', 0)*100:4.1f} %)  {r.get('reason') or ''}")
wrong = 0
for n in (2, 4):
    try:
        res = json.loads(open(f"{out}/comm_nccl_{n}.txt").read().strip().splitlines()[-1])
        wrong += sum(x["wrong"] for x in res["rows"])
        big = max(res["rows"], key=lambda x: (x["op"] == "all_reduce", x["bytes"]))
        print(f"NCCL {n} ranks: all_reduce {big['bytes']} B busbw {big['busbw_gb_s']:.2f} GB/s")
    except Exception as e:
        print(f"comm bench at {n} ranks: no result ({e})"); wrong += 1
sys.exit(0 if outcome["failed"] == 0 and wrong == 0 else 1)
PY
echo "report: $OUT/batch_size/report.md, report.html, charts/"
exit $fail
