"""Layer-wise learning-rate decay as timm groups a ViT's parameters.

Writes tests/fixtures/layer_decay.json: for a few small architectures (class token + token
pool, average pool with fc_norm, no class token), each parameter's `lr_scale` and weight decay
from timm's `param_groups_layer_decay`. `tests/users.rs` compares vitscale's optimizer groups
with it. Run from the repository root: `python reference/make_layer_decay_fixture.py`.
"""
import json

import timm
import torch
from timm.optim._param_groups import param_groups_layer_decay

CASES = {
    "token_pool": dict(img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=2, num_classes=5),
    "avg_fc_norm": dict(img_size=16, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=5,
                        global_pool="avg", fc_norm=True),
    "avg_no_class_token": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                               global_pool="avg", class_token=False),
}
DECAYS = [0.75, 0.65]


def main():
    out = {"timm": timm.__version__, "torch": torch.__version__, "cases": []}
    for name, kw in CASES.items():
        model = timm.models.vision_transformer.VisionTransformer(**kw)
        for ld in DECAYS:
            groups = param_groups_layer_decay(model, weight_decay=0.05, no_weight_decay_list=model.no_weight_decay(),
                                              layer_decay=ld)
            names = {id(p): n for n, p in model.named_parameters()}
            params = {}
            for g in groups:
                for p in g["params"]:
                    params[names[id(p)]] = {"lr_scale": g["lr_scale"], "weight_decay": g["weight_decay"]}
            out["cases"].append({"name": name, "model": kw, "layer_decay": ld, "params": params})
    with open("tests/fixtures/layer_decay.json", "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
