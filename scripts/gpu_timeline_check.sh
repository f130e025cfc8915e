#!/usr/bin/env bash
# The step's phases on the GPU's timeline, checked on one H200: a one-rank ViT-B/16 run with an
# evaluation inside it (phases against the window's wall time, eval_s, MFU), the same run with
# the timeline off (what the timing costs), bench at the same shape, two ranks sharing the GPU,
# and Chrome traces of both (the device tracks beside the host's).
#   scripts/gpu_timeline_check.sh BIN OUTDIR   (REPS, default 2: how often the timeline on/off pair runs)
BIN=$1; O=$2; mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
b16='--set model.preset=vit_base_patch16_224 --set data.dataset=synthetic --set data.train_size=8192 --set data.val_size=2048 --set model.num_classes=10 --set train_micro_batch_size_per_gpu=64 --set train.log_every=10'
# phases: sum of the six against train_s, per window; img/s; eval_s; mfu
summ() { python3 - "$1" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r.get("kind"): continue
    ph = ["data_s", "forward_s", "backward_s", "comm_s", "optimizer_s", "other_s"]
    tot = sum(r[k] for k in ph)
    n = r["steps"]
    print(f"step {r['step']:4d} img/s {r['images_per_s']:8.1f} train {r['train_s']*1e3/n:7.2f} ms/step phases {tot*1e3/n:7.2f} (timed_s {(r['timed_s'] or 0)*1e3/n:7.2f}) ratio {tot/r['train_s']:.4f} | " + " ".join(f"{k[:-2]} {r[k]*1e3/n:.2f}" for k in ph) + f" | eval_s {r['eval_s']:.3f} ckpt_s {r['checkpoint_s']:.3f} mfu {r['mfu']}")
PY
}
for rep in $(seq 1 ${REPS:-2}); do
  for tl in on off; do
    VITSCALE_TIMELINE=$tl "$BIN" train --device cuda $b16 --set train.steps=80 --set train.eval_every=40 --run-dir "$O/b16-$tl-$rep" --json > /dev/null 2> "$O/b16-$tl-$rep.err"
    echo "== ViT-B/16 micro 64, 1 rank, timeline $tl (run $rep)"; summ "$O/b16-$tl-$rep/metrics.jsonl"
  done
done
echo "== bench, same shape"
"$BIN" bench --device cuda --model vit_base_patch16_224 --micro 64 --classes 10 --steps 30 --warmup 5 --no-ceiling 2>&1 | grep "ms/step"
"$BIN" bench --device cuda --model vit_base_patch16_224 --micro 64 --classes 10 --steps 30 --warmup 5 --no-ceiling --graph off 2>&1 | grep "ms/step"
echo "== 2 ranks sharing the GPU, ViT-S/4 micro 128"
s4='--set model.preset=vit_small_patch4_32 --set data.dataset=synthetic --set data.train_size=16384 --set data.val_size=1024 --set model.num_classes=10 --set train_micro_batch_size_per_gpu=128 --set train.log_every=10 --set train.steps=60'
"$BIN" launch --one-gpu --nproc-per-node 2 -- train --device cuda $s4 --run-dir "$O/s4-2r" --trace "$O/trace2" > /dev/null 2> "$O/s4-2r.err"
for r in 0 1; do f="$O/s4-2r/metrics.jsonl"; [ $r = 1 ] && f="$O/s4-2r/rank1/metrics.jsonl"; echo "rank $r"; summ "$f"; done
echo "== 1 rank ViT-S/4 micro 128 with a trace"
"$BIN" train --device cuda $s4 --set train.steps=30 --run-dir "$O/s4-1r" --trace "$O/trace1" > /dev/null 2> "$O/s4-1r.err"
summ "$O/s4-1r/metrics.jsonl"
tail -2 "$O/s4-2r.err" "$O/b16-on-1.err"
echo "== device tracks in the traces (spans per track name; the copy stream's input copies among them)"
for f in "$O"/trace1/*.json "$O"/trace2/*.json; do
  [ -f "$f" ] || continue
  python3 - "$f" <<'PY'
import json, sys, collections
ev = json.load(open(sys.argv[1]))
ev = ev["traceEvents"] if isinstance(ev, dict) else ev
names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
count = collections.Counter(names.get((e.get("pid"), e.get("tid")), "?") for e in ev if e.get("ph") == "X")
print(sys.argv[1], dict(count), "copy stream spans:", count.get("device: copy stream", 0))
PY
done
