#!/usr/bin/env python3
"""End-to-end fixture for the command line: a tiny CIFAR-10 binary-format dataset and a timm
ViT of an unusual shape, with timm's answers for `vitscale eval` and for one `vitscale train`
SGD step over the whole training split.

    python3 reference/make_cifar_fixture.py --out tests/fixtures

Writes:
  cifar_tiny/data_batch_1.bin, cifar_tiny/test_batch.bin   CIFAR-10 binary records
      (1 label byte + 3072 bytes of R, G, B planes), random pixels, labels 0..9
  timm_cifar.safetensors
      param.<key>   initial weights (timm keys)
      sgd1.<key>    weights after one torch.optim.SGD(lr=0.1) step on the mean cross-entropy of
                    all training images (no augmentation, file order)
      eval_loss     (1,) mean cross-entropy on test_batch.bin
      metadata: model (our key names), normalisation, versions

Images are normalised as vitscale's CIFAR-10 default: x/255, then (x - mean) / std with
mean (0.4914, 0.4822, 0.4465) and std (0.2470, 0.2435, 0.2616), in float32.
"""

import argparse
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
import safetensors
import timm
from safetensors.torch import save_file

from make_fixtures import build_model, disable_fused_attn, perturb

MODEL = dict(
    image_size=32, patch_size=8, in_chans=3, embed_dim=48, depth=2, num_heads=3,
    mlp_ratio=3.0, num_classes=10, qkv_bias=False, class_token=True, global_pool="avg",
)
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
N_TRAIN, N_TEST = 40, 30


def write_cifar(path, labels, pixels):
    """pixels: (n, 3, 32, 32) uint8 -> CIFAR-10 binary records."""
    with open(path, "wb") as f:
        for lab, img in zip(labels, pixels):
            f.write(bytes([int(lab)]))
            f.write(img.astype(np.uint8).tobytes())


def normalise(pixels):
    x = torch.from_numpy(pixels.astype(np.float32)) / 255.0
    mean = torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1)
    return (x - mean) / std


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    disable_fused_attn()
    rng = np.random.default_rng(0)
    train_px = rng.integers(0, 256, size=(N_TRAIN, 3, 32, 32), dtype=np.uint8)
    test_px = rng.integers(0, 256, size=(N_TEST, 3, 32, 32), dtype=np.uint8)
    train_lab = np.arange(N_TRAIN) % 10
    test_lab = rng.integers(0, 10, size=N_TEST)
    data_dir = os.path.join(args.out, "cifar_tiny")
    os.makedirs(data_dir, exist_ok=True)
    write_cifar(os.path.join(data_dir, "data_batch_1.bin"), train_lab, train_px)
    write_cifar(os.path.join(data_dir, "test_batch.bin"), test_lab, test_px)

    model = build_model(MODEL)
    g = torch.Generator().manual_seed(1)
    perturb(model, g)
    model.eval()
    init = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}

    with torch.no_grad():
        eval_loss = F.cross_entropy(model(normalise(test_px)), torch.from_numpy(test_lab).long())

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    loss = F.cross_entropy(model(normalise(train_px)), torch.from_numpy(train_lab).long())
    opt.zero_grad()
    loss.backward()
    opt.step()

    tensors = {f"param.{k}": v for k, v in init.items()}
    tensors.update({f"sgd1.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()})
    tensors["eval_loss"] = eval_loss.reshape(1).float()
    meta = {
        "model": json.dumps(MODEL),
        "mean": json.dumps(MEAN),
        "std": json.dumps(STD),
        "sgd1": json.dumps(dict(lr=0.1, momentum=0.0, images=N_TRAIN)),
        "torch": torch.__version__,
        "timm": timm.__version__,
        "safetensors": safetensors.__version__,
    }
    save_file(tensors, os.path.join(args.out, "timm_cifar.safetensors"), metadata=meta)
    print(json.dumps(dict(eval_loss=float(eval_loss), train_loss=float(loss))))


if __name__ == "__main__":
    main()
