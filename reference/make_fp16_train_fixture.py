#!/usr/bin/env python3
"""The real DeepSpeed engine in fp16 with dynamic loss scaling: the end-to-end reference for
vitscale's loss-scaling engine (`train::loss_scale`) once fp16 compute runs on the GPU.

The training is `make_train_fixtures.py`'s (its model, data, batch split, loss and helpers,
imported from it), with `"fp16": {"enabled": true, ...}` and an initial scale of 2^20, past
fp16's range (65504) for the scaled loss gradient of this model's logits, so the first steps
overflow and are skipped while the hysteresis is spent and the scale halves; a short
`loss_scale_window` then doubles the scale again, which may overflow again. One rank, ZeRO
stages 1 and 2 (DeepSpeed's ZeRO optimizer), one case each.

Not stage 0: in DeepSpeed 0.19.8 `engine.backward` scales the loss only for a ZeRO optimizer
(or torch autocast's GradScaler), while stage 0's FP16_Optimizer still divides the gradients by
its scale in `step`, so stage 0 trains on gradients 1/scale too small and never overflows (seen
on an H100: from 2^28 the scale only doubled, no step skipped).

    python3 reference/make_fp16_train_fixture.py --fixtures tests/fixtures --out tests/fixtures/train_ref

Needs a CUDA GPU (DeepSpeed's fp16 optimizers want one), torch, timm, safetensors and
deepspeed 0.19.8. Writes per case `fp16_<case>.safetensors`:
  final.<timm key>   fp32 master weights after STEPS steps (DeepSpeed's
                     `safe_get_full_fp32_param`)
  lr                 (STEPS,) f64: the learning rate in the optimizer at each boundary
  loss               (STEPS,) f64: mean (smoothed) cross-entropy of each step's global batch
  loss_scale         (STEPS,) f64: the scale each step's backward used
  loss_scale_after   (STEPS,) f64: the scale after each step's update
  skipped            (STEPS,) f64: 1 where the step was skipped for an overflow
  skipped_steps      (STEPS,) f64: the engine's `skipped_steps` after each step
  global_steps       (STEPS,) f64: the engine's `global_steps` after each step
  metadata           vitscale: the `--set` overrides for the same case; deepspeed_config;
                     versions
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from make_cifar_fixture import N_TRAIN
from make_fixtures import disable_fused_attn, param_groups
from make_train_fixtures import ADAMW, GAS, SMOOTHING, micro_batch, new_model, read_cifar, vitscale_sets

STEPS = 16
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 20, "loss_scale_window": 4, "hysteresis": 2,
        "consecutive_hysteresis": False, "min_loss_scale": 1}
CASE = dict(
    optimizer=ADAMW,
    scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 6, "warmup_type": "linear"}},
)
CLIP = 1.0


def ds_config(stage):
    from make_train_fixtures import ds_config as base

    cfg = base(CASE, CLIP)
    cfg["fp16"] = dict(FP16)
    cfg["zero_optimization"] = {"stage": stage}
    # `torch_adam` is the fp32 path; the fp16 optimizers wrap DeepSpeed's own Adam
    cfg["optimizer"]["params"].pop("torch_adam", None)
    return cfg


def run(stage, init, x, y):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    model = new_model(init, "cuda")
    groups, _ = param_groups(model, CASE["optimizer"]["params"]["weight_decay"])
    cfg = ds_config(stage)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    rec = {k: [] for k in ["lr", "loss", "loss_scale", "loss_scale_after", "skipped", "skipped_steps", "global_steps"]}
    for step in range(STEPS):
        step_loss = 0.0
        scale = float(opt.loss_scale)
        skipped_before = engine.skipped_steps
        for m in range(GAS):
            idx = micro_batch(step, m)
            out = engine(x[idx].cuda().half())
            loss = F.cross_entropy(out.float(), y[idx].cuda(), label_smoothing=SMOOTHING)
            step_loss += float(loss) / GAS
            if engine.is_gradient_accumulation_boundary():
                rec["lr"].append(float(opt.param_groups[0]["lr"]))
            engine.backward(loss)
            engine.step()
        rec["loss"].append(step_loss)
        rec["loss_scale"].append(scale)
        rec["loss_scale_after"].append(float(opt.loss_scale))
        rec["skipped"].append(float(engine.skipped_steps - skipped_before))
        rec["skipped_steps"].append(float(engine.skipped_steps))
        rec["global_steps"].append(float(engine.global_steps))
    print(json.dumps({k: rec[k] for k in ("loss_scale", "loss_scale_after", "skipped_steps", "global_steps")}), flush=True)
    assert sum(rec["skipped"]) >= 1, "the schedule was meant to overflow at least once"
    names = {id(p): n for n, p in engine.module.named_parameters()}
    final = {names[id(p)]: safe_get_full_fp32_param(p).detach().float().cpu().contiguous() for p in engine.module.parameters()}
    return final, rec, cfg, deepspeed.__version__


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="tests/fixtures")
    ap.add_argument("--out", default="tests/fixtures/train_ref")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "fp16 reference runs need a CUDA GPU"
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    disable_fused_attn()
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29618"}.items():
        os.environ.setdefault(k, v)
    import deepspeed
    import timm

    deepspeed.init_distributed(dist_backend="nccl")
    fx = load_file(os.path.join(args.fixtures, "timm_cifar.safetensors"))
    init = {k[len("param."):]: v for k, v in fx.items() if k.startswith("param.")}
    x, y = read_cifar(os.path.join(args.fixtures, "cifar_tiny", "data_batch_1.bin"))
    assert len(y) == N_TRAIN
    os.makedirs(args.out, exist_ok=True)
    for stage in (1, 2):
        final, rec, cfg, ds_version = run(stage, init, x, y)
        tensors = {f"final.{k}": v for k, v in final.items()}
        for k, v in rec.items():
            tensors[k] = torch.tensor(v, dtype=torch.float64)
        sets = vitscale_sets(CASE, CLIP)
        sets.update({"train.steps": STEPS, "fp16": FP16, "zero_optimization": {"stage": stage}})
        meta = {
            "vitscale": json.dumps(sets),
            "deepspeed_config": json.dumps(cfg),
            "engine": f"deepspeed {ds_version} on cuda (fp16, dynamic loss scaling), one rank, ZeRO stage {stage}",
            "torch": torch.__version__,
            "timm": timm.__version__,
        }
        save_file(tensors, os.path.join(args.out, f"fp16_zero{stage}.safetensors"), metadata=meta)
        print(json.dumps(dict(stage=stage, **rec)), flush=True)


if __name__ == "__main__":
    main()
