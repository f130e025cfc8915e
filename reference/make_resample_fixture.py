#!/usr/bin/env python3
"""Position-embedding resampling fixtures for vitscale, produced with timm/PyTorch.

Writes `resample_pos_embed.safetensors` into --out:

- for each case i (see CASES: old grid, new grid, prefix tokens): `posemb.{i}`, a random
  (1, prefix + old², C) position embedding, and timm's `resample_abs_pos_embed` of it to the
  new grid with antialias=True (`aa.{i}`, timm's default) and antialias=False (`noaa.{i}`);
  the cases are in the metadata `cases` (JSON list of [old, new, prefix]);
- a tiny timm VisionTransformer made at 32 px with patch 8 (grid 4): its weights `param.*`,
  and `pos_embed_48`, the position embedding timm's `checkpoint_filter_fn` gives those weights
  when they are loaded into the same model at 48 px (grid 6) -- what
  `timm.create_model(..., pretrained=True, img_size=48)` does. Its shape is in the metadata
  `model` (vitscale's key names).

    python3 make_resample_fixture.py --out ../tests/fixtures
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F

import timm
from safetensors.torch import load_file, save_file
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

C = 5
# (old grid, new grid, prefix tokens): up- and down-sampling, by integer and other factors
CASES = [
    (2, 3, 1), (4, 6, 1), (6, 4, 1), (5, 8, 1), (8, 5, 1),
    (7, 14, 1), (14, 7, 1), (14, 24, 1), (24, 14, 1), (3, 1, 1), (1, 3, 1), (4, 9, 0),
]

MODEL = dict(
    image_size=32, patch_size=8, in_chans=3, embed_dim=16, depth=1, num_heads=2,
    mlp_ratio=2.0, num_classes=10, qkv_bias=True, class_token=True, global_pool="token",
)


def build_model(cfg, image_size):
    return VisionTransformer(
        img_size=image_size, patch_size=cfg["patch_size"], in_chans=cfg["in_chans"],
        num_classes=cfg["num_classes"], global_pool=cfg["global_pool"],
        embed_dim=cfg["embed_dim"], depth=cfg["depth"], num_heads=cfg["num_heads"],
        mlp_ratio=cfg["mlp_ratio"], qkv_bias=cfg["qkv_bias"], class_token=cfg["class_token"],
    ).float()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)

    t = {}
    for i, (old, new, prefix) in enumerate(CASES):
        pos = torch.randn((1, prefix + old * old, C), generator=g)
        aa = resample_abs_pos_embed(pos, new_size=[new, new], num_prefix_tokens=prefix)
        noaa = resample_abs_pos_embed(pos, new_size=[new, new], num_prefix_tokens=prefix, antialias=False)
        # timm's call is F.interpolate on the (1, C, H, W) grid; the prefix rows pass through
        grid = pos[:, prefix:].reshape(1, old, old, C).permute(0, 3, 1, 2)
        for got, aa_flag in ((aa, True), (noaa, False)):
            want = F.interpolate(grid, size=(new, new), mode="bicubic", align_corners=False, antialias=aa_flag)
            want = torch.cat([pos[:, :prefix], want.permute(0, 2, 3, 1).reshape(1, -1, C)], dim=1)
            assert torch.equal(got, want), (old, new, aa_flag)
        t[f"posemb.{i}"] = pos
        t[f"aa.{i}"] = aa
        t[f"noaa.{i}"] = noaa

    torch.manual_seed(1)
    small = build_model(MODEL, 32)
    with torch.no_grad():
        # non-trivial position and class-token rows (timm initialises them small)
        small.pos_embed.copy_(torch.randn(small.pos_embed.shape, generator=g))
        small.cls_token.copy_(torch.randn(small.cls_token.shape, generator=g))
    sd = {k: v.detach().clone() for k, v in small.state_dict().items()}
    large = build_model(MODEL, 48)
    filtered = checkpoint_filter_fn(dict(sd), large)
    large.load_state_dict(filtered, strict=True)
    assert filtered["pos_embed"].shape == (1, 37, MODEL["embed_dim"])
    for k, v in sd.items():
        t[f"param.{k}"] = v
    t["pos_embed_48"] = filtered["pos_embed"]

    t = {k: v.detach().to(torch.float32).contiguous() for k, v in t.items()}
    meta = {
        "cases": json.dumps(CASES),
        "model": json.dumps(MODEL),
        "torch": torch.__version__,
        "timm": timm.__version__,
    }
    path = os.path.join(args.out, "resample_pos_embed.safetensors")
    save_file(t, path, metadata=meta)
    back = load_file(path)
    assert all(torch.equal(back[k], v) for k, v in t.items())
    print(json.dumps({"file": os.path.basename(path), "bytes": os.path.getsize(path), "tensors": len(t),
                      "torch": torch.__version__, "timm": timm.__version__}))


if __name__ == "__main__":
    main()
