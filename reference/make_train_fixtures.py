#!/usr/bin/env python3
"""End-to-end training references from the real DeepSpeed engine, for `tests/train_reference.rs`.

Each case trains the timm ViT of `timm_cifar.safetensors` (32 px, patch 8, width 48, 3 heads,
no qkv bias, class token + average pooling) from that file's `param.*` weights on the 40 images
of `cifar_tiny/`, in file order without augmentation, for STEPS optimizer steps of a global
batch of 8 (micro 4 x GAS 2, one rank), through `deepspeed.initialize` in fp32 (TF32 off) with
the case's DeepSpeed config: optimizer, scheduler, `gradient_clipping` set below the gradient
norm of every step, label smoothing 0.1 in the loss, and timm's weight-decay groups (no decay
for 1-D tensors, biases, `pos_embed`, `cls_token`) passed as the engine's parameter groups.

The same training is also run as a plain PyTorch loop on the CPU (torch.optim, DeepSpeed's
scheduler classes, `clip_grad_norm_`'s max/(norm + 1e-6) rule, the loss divided by GAS): the
fixture records how far the engine and that loop are apart (`torch_loop_max_rel`).

    python3 reference/make_train_fixtures.py --fixtures tests/fixtures --out tests/fixtures/train_ref

Needs torch, timm, safetensors and deepspeed (DeepSpeed 0.19.8 wheels: `peers/get-wheels.sh`);
uses the GPU when there is one (DeepSpeed wants an accelerator). Writes per case `<case>.safetensors`:
  final.<timm key>   weights after STEPS steps (f32)
  lr                 (STEPS,) f64: the learning rate each optimizer step used
  loss               (STEPS,) f64: mean (smoothed) cross-entropy of each step's global batch
  grad_norm          (STEPS,) f64: global gradient norm before clipping
  metadata           vitscale: the `--set` overrides that make vitscale train the same case
                     (JSON object, dotted key -> JSON value); deepspeed_config; versions
"""

import argparse
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from make_cifar_fixture import MEAN, MODEL, N_TRAIN, STD
from make_fixtures import build_model, disable_fused_attn, param_groups

STEPS = 8
MICRO, GAS = 4, 2
GLOBAL = MICRO * GAS
SMOOTHING = 0.1
# gradient_clipping = CLIP_FRACTION x the smallest pre-clip norm seen without clipping, so
# clipping acts on every step.
CLIP_FRACTION = 0.5

ADAMW = {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.05, "torch_adam": True}}
CASES = {
    "adamw_warmup_lr": dict(
        optimizer=ADAMW,
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 4, "warmup_type": "linear"}},
    ),
    "adamw_warmup_decay_lr": dict(
        optimizer=ADAMW,
        scheduler={"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3, "total_num_steps": STEPS + 2, "warmup_type": "log"}},
    ),
    "adamw_warmup_cosine_lr": dict(
        optimizer=ADAMW,
        scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": STEPS, "warmup_min_ratio": 0.1, "warmup_num_steps": 3, "cos_min_ratio": 0.05, "warmup_type": "linear"}},
    ),
    "sgd_nesterov_warmup_lr": dict(
        optimizer={"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "dampening": 0.0, "weight_decay": 1e-3, "nesterov": True}},
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05, "warmup_num_steps": 3, "warmup_type": "linear"}},
    ),
}


def read_cifar(path):
    raw = np.fromfile(path, dtype=np.uint8).reshape(-1, 1 + 3 * 32 * 32)
    labels = torch.from_numpy(raw[:, 0].astype(np.int64))
    x = torch.from_numpy(raw[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32)) / 255.0
    mean = torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1)
    return (x - mean) / std, labels


def micro_batch(step, m):
    """Dataset indices of micro-batch m of global step `step` (file order, epochs repeat)."""
    steps_per_epoch = N_TRAIN // GLOBAL
    start = (step % steps_per_epoch) * GLOBAL + m * MICRO
    return list(range(start, start + MICRO))


def ds_config(case, clip):
    return {
        "train_batch_size": GLOBAL,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": clip,
        "optimizer": json.loads(json.dumps(case["optimizer"])),
        "scheduler": case["scheduler"],
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def new_model(init, device):
    model = build_model(MODEL)
    model.load_state_dict(init, strict=True)
    return model.to(device).train()


def grad_norm(model):
    return math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))


def run_deepspeed(case, clip, init, x, y, device):
    import deepspeed

    model = new_model(init, device)
    wd = case["optimizer"]["params"]["weight_decay"]
    groups, _ = param_groups(model, wd)
    engine, opt, _, sched = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config(case, clip))
    lrs, losses, norms = [], [], []
    for step in range(STEPS):
        step_loss = 0.0
        for m in range(GAS):
            idx = micro_batch(step, m)
            out = engine(x[idx].to(device))
            loss = F.cross_entropy(out, y[idx].to(device), label_smoothing=SMOOTHING)
            step_loss += float(loss) / GAS
            boundary = engine.is_gradient_accumulation_boundary()
            engine.backward(loss)
            if boundary:
                assert m == GAS - 1
                norms.append(grad_norm(engine.module))
                lrs.append(float(opt.param_groups[0]["lr"]))
                assert all(g["lr"] == lrs[-1] for g in opt.param_groups)
            engine.step()
        losses.append(step_loss)
    final = {k: v.detach().float().cpu().contiguous() for k, v in engine.module.state_dict().items()}
    return final, lrs, losses, norms, deepspeed.__version__


def run_torch_loop(case, clip, init, x, y):
    """The same training without the engine, on the CPU: the cross-check of the engine run."""
    from deepspeed.runtime import lr_schedules

    model = new_model(init, "cpu")
    p = dict(case["optimizer"]["params"])
    groups, _ = param_groups(model, p["weight_decay"])
    if case["optimizer"]["type"] == "AdamW":
        opt = torch.optim.AdamW(groups, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"], weight_decay=p["weight_decay"], foreach=False)
    else:
        opt = torch.optim.SGD(groups, lr=p["lr"], momentum=p["momentum"], dampening=p["dampening"], weight_decay=p["weight_decay"], nesterov=p["nesterov"], foreach=False)
    sched = getattr(lr_schedules, case["scheduler"]["type"])(opt, **case["scheduler"]["params"])
    lrs, norms = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for m in range(GAS):
            idx = micro_batch(step, m)
            (F.cross_entropy(model(x[idx]), y[idx], label_smoothing=SMOOTHING) / GAS).backward()
        norm = grad_norm(model)
        norms.append(norm)
        if clip > 0 and norm > 0:
            coef = clip / (norm + 1e-6)
            if coef < 1:
                for q in model.parameters():
                    q.grad.mul_(coef)
        lrs.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    final = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    return final, lrs, norms


def max_rel(a, b):
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in b)


def vitscale_sets(case, clip):
    opt = json.loads(json.dumps(case["optimizer"]))
    return {
        "train_batch_size": GLOBAL,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": clip,
        "optimizer": opt,
        "scheduler": case["scheduler"],
        "train.label_smoothing": SMOOTHING,
        "train.steps": STEPS,
        "train.log_every": 1,
        "data.dataset": "cifar10",
        "data.shuffle": False,
        "data.augment": "none",
        "model.num_heads": MODEL["num_heads"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="tests/fixtures")
    ap.add_argument("--out", default="tests/fixtures/train_ref")
    args = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(1)
    disable_fused_attn()
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29617"}.items():
        os.environ.setdefault(k, v)
    import deepspeed

    device = "cuda" if torch.cuda.is_available() else "cpu"
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    fx = load_file(os.path.join(args.fixtures, "timm_cifar.safetensors"))
    init = {k[len("param."):]: v for k, v in fx.items() if k.startswith("param.")}
    x, y = read_cifar(os.path.join(args.fixtures, "cifar_tiny", "data_batch_1.bin"))
    assert len(y) == N_TRAIN
    os.makedirs(args.out, exist_ok=True)
    import timm

    for name, case in CASES.items():
        # the unclipped norms fix the clipping threshold: below the norm at every step
        _, _, free_norms = run_torch_loop(case, 0.0, init, x, y)
        clip = float(f"{CLIP_FRACTION * min(free_norms):.3g}")
        final, lrs, losses, norms, ds_version = run_deepspeed(case, clip, init, x, y, device)
        assert min(norms) > clip, (name, norms, clip)
        t_final, t_lrs, t_norms = run_torch_loop(case, clip, init, x, y)
        loop_rel = max_rel(t_final, final)
        assert max(abs(a - b) / b for a, b in zip(t_lrs, lrs) if b) < 1e-12, (t_lrs, lrs)
        tensors = {f"final.{k}": v for k, v in final.items()}
        tensors["lr"] = torch.tensor(lrs, dtype=torch.float64)
        tensors["loss"] = torch.tensor(losses, dtype=torch.float64)
        tensors["grad_norm"] = torch.tensor(norms, dtype=torch.float64)
        meta = {
            "vitscale": json.dumps(vitscale_sets(case, clip)),
            "deepspeed_config": json.dumps(ds_config(case, clip)),
            "engine": f"deepspeed {ds_version} on {device} (fp32, TF32 off), one rank",
            "torch_loop_max_rel": f"{loop_rel:.3e}",
            "torch": torch.__version__,
            "timm": timm.__version__,
        }
        save_file(tensors, os.path.join(args.out, f"{name}.safetensors"), metadata=meta)
        print(json.dumps(dict(case=name, clip=clip, grad_norm=norms, lr=lrs, loss=losses, torch_loop_max_rel=loop_rel)), flush=True)


if __name__ == "__main__":
    main()
