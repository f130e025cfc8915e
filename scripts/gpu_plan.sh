#!/usr/bin/env bash
# The planner on one H200: the one-rank inputs, a small sweep they must predict, and the
# presets' predictions.
#   1. `bench --profile-out` of ViT-B/16 224 (micro 16..256) and ViT-S/4 32 (micro 32..512);
#   2. `bench --comm --comm-out` over NCCL with every rank on GPU 0 (`launch --one-gpu`,
#      NCCL's socket transport over loopback) at 2 and 4 ranks, 8 KiB to 64 MiB (the default
#      buckets hold at most 25 MiB);
#   3. a sweep of ViT-S/4 32 px on synthetic data: 1, 2, 4 ranks (one GPU) × micro 64, 128,
#      256, 20 steps each, then `plan --validate` (profile + comm files only) and `report`;
#   4. `plan` on the presets: 8×H200 NVLink (ViT-B/16), the study's 32 H200 nodes projected
#      (ViT-S/4), 4×8 A100 + IB recommendations (ViT-B/16).
#
#   scripts/gpu_plan.sh [BIN] [OUTDIR]
#
# Everything lands under OUTDIR; the last lines print the validation's median and max
# |error|. Exit status 0 when every step ran (the errors are reported, not judged here).
set -u
BIN=${1:-target/release/vitscale}
OUT=${2:-gpu-plan}
mkdir -p "$OUT/sweep"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
fail=0
C=configs/clusters
step() { echo "== $*"; }
run() { # name cmd...: stdout to OUT/name.txt, stderr to OUT/name.err
  local name=$1; shift
  "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err" || { echo "FAILED: $*"; tail -5 "$OUT/$name.err"; fail=1; }
  tail -n 3 "$OUT/$name.err"
}
t0=$(date +%s)

step "1. compute profiles (one rank, eager, CUDA)"
run profile_b16 "$BIN" bench --device cuda --model vit_base_patch16_224 --profile-out "$OUT/profile_b16.json" --profile-micros 16,32,64,128,256 --steps 10 --warmup 3
run profile_s4 "$BIN" bench --device cuda --model vit_small_patch4_32 --profile-out "$OUT/sweep/profile.json" --profile-micros 32,64,128,256,512 --steps 10 --warmup 3

step "2. bench --comm over NCCL, ranks on one GPU"
for n in 2 4; do
  run "comm_$n" "$BIN" launch --one-gpu --nproc-per-node "$n" -- bench --comm --device cuda --comm-max-bytes 67108864 --comm-iters 10 --warmup 3 --comm-out "$OUT/sweep/comm_$n.json"
done

step "2b. the 4-rank comm bench in two more launches (ranks time-slicing one GPU: each launch's speed is its own)"
for r in 1 2; do
  run "comm_4_again_$r" "$BIN" launch --one-gpu --nproc-per-node 4 -- bench --comm --device cuda --comm-max-bytes 67108864 --comm-iters 10 --warmup 3 --comm-ops all_reduce --comm-out "$OUT/comm_4_again_$r.json"
done
python3 - "$OUT" <<'PY'
import json, sys
for f in ("sweep/comm_4.json", "comm_4_again_1.json", "comm_4_again_2.json"):
  try:
    rows = [r for r in json.load(open(f"{sys.argv[1]}/{f}"))["rows"] if r["op"] == "all_reduce"]
    print(f"  {f}: 8 KiB all-reduce {rows[0]['time_us']/1e3:.1f} ms, 64 MiB busbw {rows[-1]['busbw_gb_s']:.2f} GB/s")
  except Exception as e:
    print(f"  {f}: {e}")
PY

step "3. sweep ViT-S/4 (1/2/4 ranks × micro 64/128/256), validate, report"
cat > "$OUT/spec.json" <<'EOF'
{
  "name": "plan_validation_s4",
  "description": "ViT-S/4 32 px on synthetic CIFAR-shaped data, every rank on GPU 0: the points `vitscale plan --validate` predicts from the one-rank profile and the comm bench.",
  "base": {
    "model": {"preset": "vit_small_patch4_32"},
    "data": {"dataset": "synthetic", "train_size": 50000, "val_size": 512, "num_workers": 4},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.0005, "weight_decay": 0.05}},
    "gradient_clipping": 1.0
  },
  "set": {"train.eval_batch_size": 256},
  "grid": {"nproc": [1, 2, 4], "train_micro_batch_size_per_gpu": [64, 128, 256]},
  "device": "cuda",
  "steps": 20,
  "warmup_steps": 5,
  "timeout_s": 240
}
EOF
# the sweep writes spec.json, sweep.jsonl and points/ into its directory; the profile and comm
# files already there are what --validate reads
run sweep "$BIN" sweep "$OUT/spec.json" --out "$OUT/sweep" --resume --json
run validate "$BIN" plan --validate "$OUT/sweep" --json
cat "$OUT/validate.txt" | grep -v '^{'
run report "$BIN" report "$OUT/sweep" --json

step "3b. more sweeps from the same inputs: GAS 4 and ZeRO-2 at 2 and 4 ranks (micro 128); a bf16 wire at 2 ranks"
python3 - "$OUT/spec.json" "$OUT" <<'PY'
import json, sys
base = json.load(open(sys.argv[1]))
extra = {
  "b": ("plan_validation_s4_gas_zero", "micro 128: gradient accumulation and ZeRO-2",
        {"nproc": [2, 4], "zero_optimization.stage": [0, 2], "gradient_accumulation_steps": [1, 4], "train_micro_batch_size_per_gpu": [128]}),
  "c": ("plan_validation_s4_bf16_wire", "2 ranks, gradients on a bf16 wire at ZeRO 0 and 2",
        {"nproc": [2], "communication_data_type": ["bf16"], "zero_optimization.stage": [0, 2], "train_micro_batch_size_per_gpu": [64, 256]}),
}
for key, (name, what, grid) in extra.items():
  s = dict(base, name=name, grid=grid)
  s["description"] = f"ViT-S/4 32 px, every rank on GPU 0, {what}: predicted from the same one-rank inputs."
  json.dump(s, open(f"{sys.argv[2]}/spec_{key}.json", "w"), indent=1)
PY
for k in b c; do
  mkdir -p "$OUT/sweep_$k"
  run "sweep_$k" "$BIN" sweep "$OUT/spec_$k.json" --out "$OUT/sweep_$k" --resume --json
  run "validate_$k" "$BIN" plan --validate "$OUT/sweep_$k" --profile "$OUT/sweep/profile.json" --comm "$OUT/sweep/comm_2.json" --comm "$OUT/sweep/comm_4.json" --json
  grep -v '^{' "$OUT/validate_$k.txt"
done

step "4. the presets"
run plan_h200 "$BIN" plan --profile "$OUT/profile_b16.json" --cluster $C/h200_8_nvlink.json --set train_micro_batch_size_per_gpu=64 --json
grep -v '^{' "$OUT/plan_h200.txt"
run project_study "$BIN" plan --profile "$OUT/sweep/profile.json" --cluster $C/study_32_nodes_h200.json --project "$OUT/projection" --micros 16,32,64,128,256 --json
grep -v '^{' "$OUT/project_study.txt" | tail -8
run recommend_a100 "$BIN" plan --profile "$OUT/profile_b16.json" --cluster $C/a100_8x4_ib200.json --recommend --global-batch 4096 --memory-limit 80 --json
grep -v '^{' "$OUT/recommend_a100.txt" | head -8
run plan_emulation "$BIN" plan --profile "$OUT/sweep/profile.json" --cluster $C/one_gpu_emulation.json --comm "$OUT/sweep/comm_2.json" --ranks-per-device 2 --set train_micro_batch_size_per_gpu=128 --json
grep -v '^{' "$OUT/plan_emulation.txt"

echo "== summary ($(( $(date +%s) - t0 )) s)"
python3 - "$OUT" <<'PY' || fail=1
import json, sys
out = sys.argv[1]
for name in ("validate", "validate_b", "validate_c"):
  try:
    v = json.loads(open(f"{out}/{name}.txt").read().strip().splitlines()[-1])
  except Exception as e:
    print(name, "unreadable:", e); continue
  print(f"{name}: {len(v['points'])} points predicted, median |error| {v['median_abs_err']*100:.1f} %, max |error| {v['max_abs_err']*100:.1f} %, "
      f"Spearman {v['spearman']}, pairs right {v['pairwise_correct']}")
  for gname, gap in v["term_gaps"]:
    print(f"  mean gap {gname}: {gap*100:.1f} % of the step")
PY
exit $fail
