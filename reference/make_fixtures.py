#!/usr/bin/env python3
"""Parity fixtures for vitscale, produced with timm/PyTorch.

Mode 1 (default): build two small timm VisionTransformers on the CPU in float32, give them
non-trivial weights, and write for each one safetensors file holding the initial weights, a
batch, the logits, the losses, every parameter gradient and the weights after a few optimizer
steps (AdamW, SGD with momentum, plain SGD). The Rust CPU backend must reproduce them.

    python3 make_fixtures.py --out tests/fixtures

Mode 2: prove that timm loads a weights file that vitscale exported (timm key names, no prefix):

    python3 make_fixtures.py --check-export W.safetensors --fixture tests/fixtures/timm_cls.safetensors \
        [--model-json '{"image_size":16,...}'] [--ref param|adamw3|sgd3|sgd1] [--tol 1e-4]

It loads W into a timm model with load_state_dict(strict=True), runs the fixture's `input`, and
compares the logits with those of the same model loaded with the fixture's `<ref>.*` weights
(`param` by default, i.e. W should be an export of the fixture's initial weights). It prints one
JSON line and exits non-zero when the max relative error exceeds --tol.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import safetensors
import timm
import timm.optim
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from timm.models.vision_transformer import VisionTransformer

B = 4
SEED = 0

CONFIGS = {
    "timm_cls": dict(
        image_size=16, patch_size=4, in_chans=3, embed_dim=32, depth=2, num_heads=4,
        mlp_ratio=4.0, num_classes=5, qkv_bias=True, class_token=True, global_pool="token",
    ),
    "timm_avg": dict(
        image_size=12, patch_size=3, in_chans=3, embed_dim=24, depth=2, num_heads=3,
        mlp_ratio=2.5, num_classes=7, qkv_bias=False, class_token=False, global_pool="avg",
    ),
}

ADAMW = dict(lr=1e-3, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.05, amsgrad=False, steps=3)
SGD3 = dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=1e-3, nesterov=False, steps=3)
SGD1 = dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, steps=1)

INIT_NOTE = (
    "timm init, then: every nn.Linear and the patch conv weight ~ N(0, 1/fan_in); every "
    "non-LayerNorm bias ~ N(0, 0.05^2); LayerNorm weight = 1 + 0.1*N(0,1), bias = 0.1*N(0,1); "
    "cls_token, pos_embed ~ N(0, 0.05^2)"
)


def disable_fused_attn():
    """Use timm's explicit softmax(q k^T * scale) v path (plain math, no SDPA kernel)."""
    try:
        from timm.layers import set_fused_attn
        set_fused_attn(False)
    except Exception:  # older/newer timm: SDPA on CPU in f32 is numerically equivalent
        pass


def build_model(cfg):
    """A timm VisionTransformer from our config names (image_size -> img_size)."""
    return VisionTransformer(
        img_size=cfg["image_size"],
        patch_size=cfg["patch_size"],
        in_chans=cfg.get("in_chans", 3),
        num_classes=cfg["num_classes"],
        global_pool=cfg["global_pool"],
        embed_dim=cfg["embed_dim"],
        depth=cfg["depth"],
        num_heads=cfg["num_heads"],
        mlp_ratio=cfg["mlp_ratio"],
        qkv_bias=cfg["qkv_bias"],
        class_token=cfg["class_token"],
        drop_rate=0.0,
        pos_drop_rate=0.0,
        proj_drop_rate=0.0,
        attn_drop_rate=0.0,
        drop_path_rate=0.0,
    ).float()


@torch.no_grad()
def perturb(model, g):
    """Make every gradient path non-trivial: LN away from 1/0, biases and tokens non-zero,
    dense weights at 1/sqrt(fan_in) so attention is far from uniform."""
    for mod in model.modules():
        if isinstance(mod, nn.LayerNorm):
            mod.weight.copy_(1.0 + 0.1 * torch.randn(mod.weight.shape, generator=g))
            mod.bias.copy_(0.1 * torch.randn(mod.bias.shape, generator=g))
        elif isinstance(mod, (nn.Linear, nn.Conv2d)):
            fan_in = mod.weight[0].numel()
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) / fan_in ** 0.5)
            if mod.bias is not None:
                mod.bias.copy_(0.05 * torch.randn(mod.bias.shape, generator=g))
    if model.cls_token is not None:
        model.cls_token.copy_(0.05 * torch.randn(model.cls_token.shape, generator=g))
    model.pos_embed.copy_(0.05 * torch.randn(model.pos_embed.shape, generator=g))


def param_groups(model, weight_decay):
    """timm's groups: no decay for 1-D params and for model.no_weight_decay() names.
    Checked against our own reading of the rule."""
    nwd = set(model.no_weight_decay())
    assert nwd >= {"pos_embed", "cls_token"}, nwd
    groups = timm.optim.param_groups_weight_decay(model, weight_decay, no_weight_decay_list=nwd)
    by_id = {id(p): n for n, p in model.named_parameters()}
    got = {}
    for grp in groups:
        for p in grp["params"]:
            got[by_id[id(p)]] = grp["weight_decay"]
    want = {
        n: (0.0 if (p.ndim <= 1 or n.endswith(".bias") or n in nwd) else weight_decay)
        for n, p in model.named_parameters()
    }
    assert got == want, (got, want)
    return groups, sorted(n for n, wd in want.items() if wd == 0.0)


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def train(model, init_sd, x, y, make_opt, steps):
    """Reset to init_sd, take `steps` optimizer steps on the same batch, return the weights."""
    model.load_state_dict(init_sd, strict=True)
    opt = make_opt(model)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(model, x, y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_one(name, cfg, out_dir):
    g = torch.Generator().manual_seed(SEED + (0 if name == "timm_cls" else 1))
    torch.manual_seed(SEED)
    model = build_model(cfg)
    model.train()  # no dropout anywhere (all rates 0), so train == eval
    perturb(model, g)
    init_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    assert set(names) == set(init_sd), "state_dict holds non-parameter entries"

    s = cfg["image_size"]
    k = cfg["num_classes"]
    x = torch.randn((B, cfg["in_chans"], s, s), generator=g)
    y = torch.randperm(k, generator=g)[:B]  # distinct classes
    assert y.numel() == B

    # forward, losses, gradients at the initial weights
    model.zero_grad(set_to_none=True)
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss_smooth = F.cross_entropy(logits, y, label_smoothing=0.1)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    def adamw(m):
        groups, _ = param_groups(m, ADAMW["weight_decay"])
        return torch.optim.AdamW(groups, lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]),
                                 eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"],
                                 amsgrad=False, foreach=False)

    def sgd3(m):
        groups, _ = param_groups(m, SGD3["weight_decay"])
        return torch.optim.SGD(groups, lr=SGD3["lr"], momentum=SGD3["momentum"],
                               dampening=0.0, weight_decay=SGD3["weight_decay"],
                               nesterov=False, foreach=False)

    def sgd1(m):
        return torch.optim.SGD(m.parameters(), lr=SGD1["lr"], momentum=0.0, weight_decay=0.0,
                               foreach=False)

    w_adamw = train(model, init_sd, x, y, adamw, ADAMW["steps"])
    w_sgd3 = train(model, init_sd, x, y, sgd3, SGD3["steps"])
    w_sgd1 = train(model, init_sd, x, y, sgd1, SGD1["steps"])
    _, no_decay = param_groups(model, 0.05)

    t = {}
    for n in init_sd:
        t[f"param.{n}"] = init_sd[n]
    t["input"] = x
    t["labels"] = y.to(torch.float32)
    t["logits"] = logits.detach()
    t["loss"] = loss.detach().reshape(1)
    t["loss_smooth"] = loss_smooth.detach().reshape(1)
    for n in init_sd:
        t[f"grad.{n}"] = grads[n]
    for n in init_sd:
        t[f"adamw3.{n}"] = w_adamw[n]
    for n in init_sd:
        t[f"sgd3.{n}"] = w_sgd3[n]
    for n in init_sd:
        t[f"sgd1.{n}"] = w_sgd1[n]
    t = {kk: v.detach().to(torch.float32).contiguous() for kk, v in t.items()}
    for kk, v in t.items():
        assert torch.isfinite(v).all(), kk

    meta = {
        "model": json.dumps(cfg),
        "adamw": json.dumps({**ADAMW, "no_decay": "1-D params, *.bias, model.no_weight_decay()"}),
        "sgd3": json.dumps({**SGD3, "no_decay": "1-D params, *.bias, model.no_weight_decay()"}),
        "sgd1": json.dumps(SGD1),
        "no_decay_params": json.dumps(no_decay),
        "param_order": json.dumps(list(init_sd)),
        "batch": str(B),
        "loss": "mean cross-entropy; loss_smooth: label_smoothing=0.1; grad.* of loss",
        "init": INIT_NOTE,
        "torch": torch.__version__,
        "timm": timm.__version__,
        "safetensors": getattr(safetensors, "__version__", "?"),
        "device": "cpu float32",
    }
    path = os.path.join(out_dir, f"{name}.safetensors")
    save_file(t, path, metadata=meta)

    # self-check: the file reloads into timm and reproduces the logits and loss
    chk = load_file(path)
    m2 = build_model(cfg)
    m2.load_state_dict({n: chk[f"param.{n}"] for n in init_sd}, strict=True)
    with torch.no_grad():
        l2 = m2(chk["input"])
    assert torch.equal(l2, chk["logits"]), "reload does not reproduce logits"
    print(json.dumps({
        "file": os.path.basename(path), "bytes": os.path.getsize(path), "tensors": len(t),
        "params": sum(v.numel() for v in init_sd.values()), "loss": loss.item(),
        "loss_smooth": loss_smooth.item(), "labels": y.tolist(),
        "grad_norm": float(torch.sqrt(sum((gg ** 2).sum() for gg in grads.values()))),
        "logits_abs_max": logits.abs().max().item(),
    }))


def read_fixture(path):
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    return load_file(path), meta


def rel_err(a, b):
    d = (a - b).abs()
    return {
        "max_abs": d.max().item(),
        # norm-wise: largest difference over the largest reference magnitude
        "max_rel": (d.max() / b.abs().max().clamp_min(1e-30)).item(),
        # element-wise with a floor so that near-zero entries do not dominate
        "max_rel_elem": (d / (b.abs() + 1e-6)).max().item(),
    }


def check_export(args):
    fx, meta = read_fixture(args.fixture)
    cfg = json.loads(args.model_json) if args.model_json else json.loads(meta["model"])
    x = fx["input"]

    exported = load_file(args.check_export)
    exported = {k: v.to(torch.float32) for k, v in exported.items()}
    m = build_model(cfg).eval()
    m.load_state_dict(exported, strict=True)  # raises on any missing / unexpected key or shape

    ref_sd = {k[len(args.ref) + 1:]: v for k, v in fx.items() if k.startswith(args.ref + ".")}
    if not ref_sd:
        sys.exit(f"fixture {args.fixture} has no tensors with prefix '{args.ref}.'")
    r = build_model(cfg).eval()
    r.load_state_dict(ref_sd, strict=True)

    with torch.no_grad():
        got = m(x)
        want = r(x)
    res = {"export": os.path.basename(args.check_export), "fixture": os.path.basename(args.fixture),
           "ref": args.ref, "keys": len(exported), "logits": rel_err(got, want)}
    if args.ref == "param":
        res["logits_vs_fixture"] = rel_err(got, fx["logits"])
    worst = max(rel_err(exported[k], ref_sd[k])["max_rel"] for k in ref_sd)
    res["weights_max_rel"] = worst
    res["ok"] = res["logits"]["max_rel"] <= args.tol
    print(json.dumps(res))
    return 0 if res["ok"] else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures", help="directory for the fixture files")
    ap.add_argument("--check-export", metavar="W.safetensors", help="weights exported by vitscale")
    ap.add_argument("--model-json", help="model config (our key names); default: the fixture's")
    ap.add_argument("--fixture", help="fixture whose input (and reference weights) to use")
    ap.add_argument("--ref", default="param", choices=["param", "adamw3", "sgd3", "sgd1"],
                    help="fixture weights the export is compared with")
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative logits error to pass")
    args = ap.parse_args()

    torch.set_num_threads(1)  # fixed reduction order
    torch.use_deterministic_algorithms(True)
    disable_fused_attn()

    if args.check_export:
        if not args.fixture:
            ap.error("--check-export needs --fixture")
        sys.exit(check_export(args))

    os.makedirs(args.out, exist_ok=True)
    print(json.dumps({"torch": torch.__version__, "timm": timm.__version__}))
    for name, cfg in CONFIGS.items():
        make_one(name, cfg, args.out)


if __name__ == "__main__":
    main()
