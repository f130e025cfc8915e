#!/usr/bin/env python3
"""timm parity fixture for a head dim of 80 (ViT-H/14's), produced with timm/PyTorch.

A timm VisionTransformer with embed_dim 160 and 2 heads (head dim 80), depth 2, 8 px images
with patch 4, on the CPU in float32 with timm's explicit attention path (as make_fixtures.py).
To keep the file small its weights are not stored: every weight is a function of its key and
element index that tests/timm_parity.rs computes the same way (`formula_weights` below: a
SplitMix64 hash of (tensor number in sorted key order, element index), mapped to uniform
values: dense and patch-conv weights of std 1/sqrt(fan_in), LayerNorm weights 1 +- 0.2,
every other tensor +-0.1; all exact in IEEE double, rounded once to float32). Stored: `input`,
`labels`, `logits`, `loss` (mean CE), `loss_smooth` (label_smoothing=0.1), and the gradient of
`loss`: whole as `grad.<key>` for tensors of at most 4096 elements, else every 17th element of
the flattened gradient as `gsample.<key>` with its whole L2 norm as `gnorm.<key>`.

    python3 make_hd80_fixture.py --out ../tests/fixtures
"""

import argparse
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

import timm
from safetensors.torch import load_file, save_file

from make_fixtures import build_model, disable_fused_attn

CFG = dict(
    image_size=8, patch_size=4, in_chans=3, embed_dim=160, depth=2, num_heads=2,
    mlp_ratio=1.0, num_classes=5, qkv_bias=True, class_token=True, global_pool="token",
)
B = 3
WHOLE_MAX = 4096
STRIDE = 17
M64 = (1 << 64) - 1


def splitmix64(x):
    """SplitMix64's output function on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def formula_weights(state_dict):
    out = {}
    for t, name in enumerate(sorted(state_dict)):
        shape = tuple(state_dict[name].shape)
        n = int(np.prod(shape))
        i = np.arange(n, dtype=np.uint64)
        u = (splitmix64((np.uint64(t) << np.uint64(32)) | i) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
        if len(shape) >= 2 and name not in ("pos_embed", "cls_token"):
            fan_in = int(np.prod(shape[1:]))
            centre, half = 0.0, math.sqrt(3.0 / fan_in)
        elif "norm" in name and name.endswith(".weight"):
            centre, half = 1.0, 0.2
        else:
            centre, half = 0.0, 0.1
        v = centre + half * (2.0 * u - 1.0)
        out[name] = torch.from_numpy(v.astype(np.float32).reshape(shape))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    disable_fused_attn()

    model = build_model(CFG)
    assert model.blocks[0].attn.head_dim == 80
    w = formula_weights(model.state_dict())
    model.load_state_dict(w, strict=True)
    model.train()  # every dropout rate is 0: train == eval

    g = torch.Generator().manual_seed(80)
    s = CFG["image_size"]
    x = torch.randn((B, CFG["in_chans"], s, s), generator=g)
    y = torch.randperm(CFG["num_classes"], generator=g)[:B]
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss_smooth = F.cross_entropy(logits, y, label_smoothing=0.1)
    loss.backward()

    t = {"input": x, "labels": y.to(torch.float32), "logits": logits.detach(),
         "loss": loss.detach().reshape(1), "loss_smooth": loss_smooth.detach().reshape(1)}
    for name, p in model.named_parameters():
        gr = p.grad.detach().reshape(-1)
        if gr.numel() <= WHOLE_MAX:
            t[f"grad.{name}"] = p.grad.detach()
        else:
            t[f"gsample.{name}"] = gr[::STRIDE].clone()
            t[f"gnorm.{name}"] = gr.double().norm().reshape(1)
    t = {k: v.detach().to(torch.float32).contiguous() for k, v in t.items()}
    meta = {
        "model": json.dumps(CFG),
        "weights": "formula_weights in reference/make_hd80_fixture.py",
        "stride": str(STRIDE),
        "whole_max": str(WHOLE_MAX),
        "torch": torch.__version__,
        "timm": timm.__version__,
        "device": "cpu float32",
    }
    path = os.path.join(args.out, "timm_hd80.safetensors")
    save_file(t, path, metadata=meta)
    chk = load_file(path)
    m2 = build_model(CFG)
    m2.load_state_dict(formula_weights(m2.state_dict()), strict=True)
    with torch.no_grad():
        assert torch.equal(m2(chk["input"]), chk["logits"]), "reload does not reproduce logits"
    print(json.dumps({"file": os.path.basename(path), "bytes": os.path.getsize(path), "tensors": len(t),
                      "params": sum(p.numel() for p in model.parameters()), "loss": loss.item(),
                      "labels": y.tolist(), "torch": torch.__version__, "timm": timm.__version__}))


if __name__ == "__main__":
    main()
