#!/usr/bin/env bash
# vitscale's fp16 training on the GPU against the real DeepSpeed engine in fp16
# (`reference/make_fp16_train_fixture.py`: one rank, dynamic loss scaling from 2^18, a schedule
# that overflows, ZeRO 1 and 2). Each case trains with the fixture's own `--set` overrides from
# its `param.*` initial weights on `tests/fixtures/cifar_tiny`, logging every step, then
# compares per step the loss scale after the step and the skipped steps (exactly), the losses,
# and the final weights (largest per-tensor relative L2 error). One JSON line per case.
#
#   scripts/gpu_fp16_deepspeed_check.sh BIN OUT FIXTURE_DIR [DEVICE]
# FIXTURE_DIR holds fp16_zero1.safetensors and fp16_zero2.safetensors; DEVICE is cuda
# (default) or cpu.
set -u
BIN=$1; OUT=$2; FX=$3; DEV=${4:-cuda}
mkdir -p "$OUT"
python3 - "$BIN" "$OUT" "$FX" "$DEV" <<'PY'
import json, os, subprocess, sys
import numpy as np
from safetensors.numpy import load_file, save_file
from safetensors import safe_open

bin_, out, fx, dev = sys.argv[1:5]
init = os.path.join(out, "init.safetensors")
params = load_file("tests/fixtures/timm_cifar.safetensors")
save_file({k[len("param."):]: v for k, v in params.items() if k.startswith("param.")}, init)
ok_all = True
for stage in (1, 2):
    path = os.path.join(fx, f"fp16_zero{stage}.safetensors")
    with safe_open(path, "np") as f:
        meta = f.metadata()
        ref = {k: f.get_tensor(k) for k in f.keys()}
    sets = json.loads(meta["vitscale"])
    sets["data.path"] = "tests/fixtures/cifar_tiny"
    sets["train.log_every"] = 1
    run_dir, saved = os.path.join(out, f"zero{stage}"), os.path.join(out, f"zero{stage}.safetensors")
    args = [bin_, "train", "--device", dev, "--json", "--init", init, "--save-weights", saved, "--run-dir", run_dir]
    for k, v in sets.items():
        args += ["--set", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        print(json.dumps({"stage": stage, "error": r.stderr.strip()[-600:]}))
        ok_all = False
        continue
    recs = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.startswith("{")]
    recs = [x for x in recs if "step" in x and "loss" in x]
    scale = [x.get("loss_scale") for x in recs]
    skipped = [x.get("skipped_steps") for x in recs]
    loss = [x["loss"] for x in recs]
    want_scale = [float(v) for v in ref["loss_scale_after"]]
    want_skipped = [int(v) for v in ref["skipped_steps"]]
    ours = load_file(saved)
    errs = {}
    for k, v in ref.items():
        if k.startswith("final."):
            key = k[len("final."):]
            a, b = ours[key].astype(np.float64).ravel(), v.astype(np.float64).ravel()
            errs[key] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    worst = max(errs, key=errs.get)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(loss, ref["loss"])) if len(loss) == len(ref["loss"]) else float("inf")
    same_scale = scale == want_scale and skipped == want_skipped
    # fp16 compute on two different engines: weights within 5e-2 (relative L2, worst tensor)
    ok = same_scale and errs[worst] <= 5e-2
    ok_all &= ok
    print(json.dumps({"stage": stage, "device": dev, "pass": ok, "loss_scale": scale, "deepspeed_loss_scale": want_scale,
                      "skipped_steps": skipped, "deepspeed_skipped_steps": want_skipped, "max_loss_rel_err": loss_err,
                      "worst_weight": worst, "worst_weight_rel_l2": errs[worst]}))
sys.exit(0 if ok_all else 1)
PY
