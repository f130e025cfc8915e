#!/usr/bin/env python3
"""torchvision's side of the torchvision interop fixture (`tests/torchvision_interop.rs`).

Both directions, in float32 on the CPU with one thread:

1. torchvision -> vitscale. For each model in `MODELS`, build
   `torchvision.models.vision_transformer.VisionTransformer(...)`, give every parameter seeded
   random values (torchvision's own init leaves the head at zero and the class token at zero,
   which would hide a wrong mapping), run a seeded input and write
   - `tv_<name>.safetensors`: the model's `state_dict()` exactly as torchvision names it (for
     `legacy`, the MLP keys renamed to `mlp.linear_1` / `mlp.linear_2`, the names torchvision
     used before 0.13 and still accepts), nothing else;
   - `tv_<name>_logits.safetensors`: `input` (B, 3, H, W) and `logits` (B, classes), with the
     constructor arguments in the metadata (`torchvision_args`).

2. vitscale -> torchvision. For `vitscale_export.safetensors` in DIR (a file vitscale wrote with
   `--weights-format torchvision`, its model in the `vitscale_model` metadata), build that
   torchvision model, `load_state_dict(strict=True)` (a missing, extra or mis-shaped key fails),
   run a seeded input and write `vitscale_export_torchvision.safetensors` with `input` and
   `logits`.

    python3 reference/make_torchvision_fixture.py tests/fixtures/torchvision
"""

import json
import os
import sys

import safetensors
import torch
import torchvision
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torchvision.models.vision_transformer import VisionTransformer

B = 3

# name -> VisionTransformer arguments
MODELS = {
    # the shape the study's vit_b_16 has, scaled down: 16 patches, heads of width 16
    "small": dict(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10),
    # odd sizes: 9 patches, 3 heads of width 8, MLP ratio 5/3, one layer; old MLP key names
    "legacy": dict(image_size=12, patch_size=4, num_layers=1, num_heads=3, hidden_dim=24, mlp_dim=40, num_classes=7),
}


def randomize(model, seed):
    """Every parameter non-trivial: dense/conv weights uniform with std 1/sqrt(fan in), LayerNorm
    weights 1 +- 0.2, biases, class token and position embedding +- 0.1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            u = torch.rand(p.shape, generator=g) * 2 - 1
            is_norm = ".ln" in name or name.startswith("ln")
            if is_norm and name.endswith("weight"):
                p.copy_(1 + 0.2 * u)
            elif p.dim() >= 2 and name not in ("class_token", "encoder.pos_embedding"):
                fan_in = p[0].numel()
                p.copy_(u * (3.0 / fan_in) ** 0.5)
            else:
                p.copy_(0.1 * u)


def versions():
    return {"torch": torch.__version__, "torchvision": torchvision.__version__, "safetensors": safetensors.__version__}


def from_torchvision(out_dir):
    for i, (name, args) in enumerate(MODELS.items()):
        model = VisionTransformer(**args).eval()
        randomize(model, 2000 + i)
        g = torch.Generator().manual_seed(300 + i)
        x = torch.randn((B, 3, args["image_size"], args["image_size"]), generator=g)
        with torch.no_grad():
            logits = model(x)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if name == "legacy":
            state = {k.replace(".mlp.0.", ".mlp.linear_1.").replace(".mlp.3.", ".mlp.linear_2."): v for k, v in state.items()}
            # torchvision itself still loads the old names into the same model
            again = VisionTransformer(**args).eval()
            again.load_state_dict(state, strict=True)
            with torch.no_grad():
                assert torch.equal(again(x), logits)
        save_file(state, os.path.join(out_dir, f"tv_{name}.safetensors"))
        meta = {"torchvision_args": json.dumps(args), **versions()}
        save_file({"input": x.contiguous(), "logits": logits.contiguous()}, os.path.join(out_dir, f"tv_{name}_logits.safetensors"), metadata=meta)
        print(json.dumps(dict(name=name, keys=len(state), logits_max=float(logits.abs().max()), args=args)), flush=True)


def to_torchvision(out_dir):
    path = os.path.join(out_dir, "vitscale_export.safetensors")
    with safe_open(path, "pt") as f:
        cfg = json.loads(f.metadata()["vitscale_model"])
    assert cfg["class_token"] and cfg["global_pool"] == "token" and cfg["qkv_bias"] and cfg["in_chans"] == 3, cfg
    args = dict(
        image_size=cfg["image_size"],
        patch_size=cfg["patch_size"],
        num_layers=cfg["depth"],
        num_heads=cfg["num_heads"],
        hidden_dim=cfg["embed_dim"],
        mlp_dim=int(cfg["embed_dim"] * cfg["mlp_ratio"]),
        num_classes=cfg["num_classes"],
    )
    model = VisionTransformer(**args).eval()
    model.load_state_dict(load_file(path), strict=True)
    g = torch.Generator().manual_seed(400)
    x = torch.randn((B, 3, args["image_size"], args["image_size"]), generator=g)
    with torch.no_grad():
        logits = model(x)
    meta = {"torchvision_args": json.dumps(args), "loaded": "vitscale_export.safetensors with load_state_dict(strict=True)", **versions()}
    save_file({"input": x.contiguous(), "logits": logits.contiguous()}, os.path.join(out_dir, "vitscale_export_torchvision.safetensors"), metadata=meta)
    print(json.dumps(dict(name="vitscale_export", logits_max=float(logits.abs().max()), args=args)), flush=True)


def main():
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    from_torchvision(out_dir)
    if os.path.exists(os.path.join(out_dir, "vitscale_export.safetensors")):
        to_torchvision(out_dir)
    else:
        print("no vitscale_export.safetensors yet: see tests/torchvision_interop.rs", file=sys.stderr)


if __name__ == "__main__":
    main()
