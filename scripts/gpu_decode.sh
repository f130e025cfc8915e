#!/usr/bin/env bash
# GPU image decode on one GPU, in one call: ImageNet-size JPEGs made from real photographs
# (PEERS/make_photos.py), `bench --data` on them (CPU pipeline and GPU decode points), then
# ViT-S/16 and ViT-B/16 at 224 px, micro 256, trained from the folder with data.decode cpu
# (all cores) and gpu (few loader threads) against the same model on synthetic data, and the
# peer (PEERS/peer_realdata.py: torchvision + timm ViT-B/16 from the folder). Each run's img/s is the
# median of its metrics windows after the first two; data_s is its time waiting for data; the
# phases are those windows' device-timed milliseconds a step.
#   scripts/gpu_decode.sh BIN OUT PEERS_DIR [MODELS] [STEPS]
# MODES (default "synthetic cpu16 gpu4 gpu2") picks the runs per model (gpu4h: gpu4 with nvJPEG's
# GPU-assisted Huffman decoder for the batched call, VITSCALE_NVJPEG_BATCHED=gpu_hybrid;
# synthetic8 and gpu4q8: synthetic and gpu4 with the driver's default 8 hardware queues,
# CUDA_DEVICE_MAX_CONNECTIONS=8, instead of the 32 vitscale asks for; shards_cpu16, shards_gpu4,
# shards_gpu2: cpu16, gpu4, gpu2 from tar shards that `data pack` makes of the folder; a mode
# ending in lo, e.g. gpu2lo, runs the decode stream at normal priority, VITSCALE_DECODE_PRIORITY;
# one ending in roi, e.g. gpu2roi, decodes only the crops' windows, VITSCALE_NVJPEG_ROI=on; one
# ending in c and two digits, e.g. gpu2c35, has the loader threads decode that share of the
# JPEGs on the CPU, data.decode_cpu_share=0.35; one ending in da, e.g. gpu2da, decodes the
# batch after next ahead, VITSCALE_DECODE_AHEAD=on, one ending in na with it off;
# a mode may repeat, each run has a folder run-MODEL-MODE-K of its own), SECS
# (2) the seconds per bench point, TRAIN_TIMEOUT (150) the seconds a training run may take, PEER=0 skips the peer, DATA_BENCH=0 skips `bench --data`.
# Mode synthetic_w4 is synthetic with 4 loader threads instead of one a core (whether the
# synthetic run's host copies wait for cores the loader holds).
# With BIN_B set (another build, to compare with in the same call), a mode ending in _b, e.g.
# gpu2_b, runs that binary instead of BIN. A mode ending in _t and a number (before any _b), e.g.
# gpu4_t4, runs the whole process on that many cores (taskset -c 0-(N-1)): every thread of it,
# not only the loader's.
# TRACE=1 traces each run (--trace OUT/trace-RUN) and prints scripts/trace_spans.py's summary of it.
BIN=$1; O=$2; P=$3; MODELS=${4:-"vit_small_patch16_224 vit_base_patch16_224"}; STEPS=${5:-60}
export PYTHONUNBUFFERED=1
mkdir -p "$O"
t0=$SECONDS
[ -d "$O/photos/flat" ] || python3 "$P/make_photos.py" "$O/photos" 100 60 > "$O/photos.log" 2>&1
echo "photos: $(tail -1 "$O/photos.log") ($((SECONDS - t0)) s)"
case "${MODES:-}" in *shards*)
  [ -d "$O/photos/shards" ] || "$BIN" data pack "$O/photos/folder" "$O/photos/shards" --shard-size 16MiB > "$O/pack.log" 2>&1
  echo "pack: $(tail -1 "$O/pack.log")" ;;
esac
if [ "${DATA_BENCH:-1}" = 1 ]; then
  timeout 150 "$BIN" bench --data --jpeg-dir "$O/photos/flat" --threads 16 --secs "${SECS:-2}" --json > "$O/data.log" 2>&1
  echo "bench --data rc $? ($((SECONDS - t0)) s)"; grep -E "^(jpeg|pipeline)" "$O/data.log"
fi
median() { python3 - "$1" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
rows = [r for r in rows if "images_per_s" in r][2:]
if not rows: print("n/a"); sys.exit()
ips = statistics.median(r["images_per_s"] for r in rows)
data = statistics.median(r["data_s"] / max(r["train_s"], 1e-9) for r in rows)
# the device-timed phases per step (docs/lab.md): where a decode's cost lands
steps = sum(r["steps"] for r in rows)
ms = {k: 1e3 * sum(r.get(k + "_s", 0.0) for r in rows) / steps for k in ("data", "forward", "backward", "optimizer")}
print(f"{ips:.0f} img/s, data wait {100 * data:.0f} % of the step; ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
PY
}
for model in $MODELS; do
  common=(--device cuda --json --set model.preset=$model --set model.num_classes=100 --set train_micro_batch_size_per_gpu=256
          --set train.steps=$STEPS --set train.log_every=5 --set bf16.enabled=true --set train.eval_every=0)
  k=0
  for mode in ${MODES:-synthetic cpu16 gpu4 gpu2}; do
    k=$((k + 1))
    # a mode is a base run (synthetic, cpu16, gpu4, gpu2, gpu4h) with an optional source
    # (shards_) and queue count (…8 / …q8) around it
    envs=(VITSCALE_NVJPEG_BATCHED=hardware)
    src=(--set data.dataset=folder --set data.path="$O/photos/folder")
    base=$mode
    share=()
    bin=$BIN
    case $base in *_b) bin=${BIN_B:?a mode ending in _b needs BIN_B}; base=${base%_b} ;; esac
    pin=()
    case $base in *_t[0-9]*) pin=(taskset -c 0-$((${base##*_t} - 1))); base=${base%_t*} ;; esac
    case $base in *c[0-9][0-9]) share=(--set data.decode_cpu_share=0.${base##*c}); base=${base%c[0-9][0-9]} ;; esac
    case $base in *da) envs+=(VITSCALE_DECODE_AHEAD=on); base=${base%da} ;; *na) envs+=(VITSCALE_DECODE_AHEAD=off); base=${base%na} ;; esac
    case $base in *lo) envs+=(VITSCALE_DECODE_PRIORITY=normal); base=${base%lo} ;; esac
    case $base in *roi) envs+=(VITSCALE_NVJPEG_ROI=on); base=${base%roi} ;; esac
    case $base in synthetic8|*q8) envs+=(CUDA_DEVICE_MAX_CONNECTIONS=8); base=${base%8}; base=${base%q} ;; esac
    case $base in shards_*) src=(--set data.dataset=shards --set data.path="$O/photos/shards"); base=${base#shards_} ;; esac
    case $base in
      synthetic) extra=(--set data.dataset=synthetic --set data.train_size=6000 --set data.val_size=512) ;;
      synthetic_w4) extra=(--set data.dataset=synthetic --set data.train_size=6000 --set data.val_size=512 --set data.num_workers=4) ;;
      cpu16) extra=("${src[@]}" --set data.decode=cpu --set data.num_workers=16) ;;
      gpu4|gpu2) extra=("${src[@]}" --set data.decode=gpu --set data.num_workers=${base#gpu} "${share[@]}") ;;
      gpu4h) extra=("${src[@]}" --set data.decode=gpu --set data.num_workers=4 "${share[@]}")
             envs=(VITSCALE_NVJPEG_BATCHED=gpu_hybrid) ;;
      *) echo "unknown mode $mode"; continue ;;
    esac
    run=$model-$mode-$k
    rm -rf "$O/run-$run"
    trace=(); [ "${TRACE:-0}" = 1 ] && rm -rf "$O/trace-$run" && trace=(--trace "$O/trace-$run")
    env "${envs[@]}" timeout "${TRAIN_TIMEOUT:-150}" "${pin[@]}" "$bin" train "${common[@]}" "${extra[@]}" "${trace[@]}" --run-dir "$O/run-$run" > "$O/train-$run.log" 2>&1
    rc=$?
    echo "$model $mode rc $rc ($((SECONDS - t0)) s): $(median "$O/run-$run/metrics.jsonl" 2>/dev/null) | $(tail -1 "$O/train-$run.log" | cut -c1-160)"
    [ $rc -ne 0 ] && grep -iE "error|panick" "$O/train-$run.log" | head -3
    [ "${TRACE:-0}" = 1 ] && python3 "$(dirname "$0")/trace_spans.py" "$O/trace-$run/trace-rank0.json"
  done
done
# the peer trains ViT-B/16 (15 loader workers)
[ "${PEER:-1}" = 1 ] && timeout 150 python3 "$P/peer_realdata.py" "$O/photos/folder/train" 256 15 40 2>> "$O/peer.err" | tail -1 | sed "s/^/peer vit_base_patch16_224: /"
echo "total $((SECONDS - t0)) s"
