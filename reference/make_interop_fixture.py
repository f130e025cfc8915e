#!/usr/bin/env python3
"""timm's side of the interop fixture (`tests/interop.rs`): timm loads what vitscale writes.

For every `<name>_export.safetensors` in DIR (weights that vitscale's `weights::save` wrote, with
the model in their `vitscale_model` metadata), build that timm VisionTransformer, load the file
with `load_state_dict(strict=True)` (a missing, extra or mis-shaped key fails), run it in float32
on the CPU on a seeded input, and write `<name>_timm.safetensors` with `input` (B, 3, H, W) and
`logits` (B, classes).

    python3 reference/make_interop_fixture.py tests/fixtures/interop
"""

import glob
import json
import os
import sys

import torch
import timm
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from make_fixtures import build_model, disable_fused_attn

B = 3


def main():
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    disable_fused_attn()
    files = sorted(glob.glob(os.path.join(out_dir, "*_export.safetensors")))
    assert files, f"no *_export.safetensors in {out_dir}"
    for i, path in enumerate(files):
        with safe_open(path, "pt") as f:
            cfg = json.loads(f.metadata()["vitscale_model"])
        model = build_model(cfg)
        model.load_state_dict(load_file(path), strict=True)
        model.eval()
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn((B, cfg.get("in_chans", 3), cfg["image_size"], cfg["image_size"]), generator=g)
        with torch.no_grad():
            logits = model(x)
        name = os.path.basename(path)[: -len("_export.safetensors")]
        meta = {"model": json.dumps(cfg), "torch": torch.__version__, "timm": timm.__version__, "loaded": os.path.basename(path) + " with load_state_dict(strict=True)"}
        save_file({"input": x.contiguous(), "logits": logits.contiguous()}, os.path.join(out_dir, f"{name}_timm.safetensors"), metadata=meta)
        print(json.dumps(dict(name=name, logits_max=float(logits.abs().max()), model=cfg)), flush=True)


if __name__ == "__main__":
    main()
