#!/usr/bin/env python3
"""Two `vitscale train` runs of the same global batch compared, for the GPU check scripts
(gpu_zero_check.sh, gpu_zero3_check.sh, gpu_sp_check.sh): the largest per-step loss difference
(relative), the largest final-weight difference (of 1 + |w|, from each run's
`--save-weights` file `w.safetensors`), and whether every rank of run A ended with rank 0's
weights (`rankR/summary.json`'s weights_hash). Prints one JSON line; exits 1 when a tolerance is
exceeded, the step counts differ or the ranks disagree.

    compare_runs.py DIR_A DIR_B LABEL LOSS_TOL WEIGHT_TOL WORLD_A
"""
import json
import struct
import sys


def steps(d):
    return [json.loads(l) for l in open(d + "/metrics.jsonl") if '"kind"' not in l]


def read_f32_safetensors(path):
    """The f32 tensors of a safetensors file, read without the safetensors package."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for k, v in head.items():
        if k == "__metadata__":
            continue
        s, e = v["data_offsets"]
        out[k] = struct.unpack("<%df" % ((e - s) // 4), data[s:e])
    return out


def weights(d):
    """A run's saved weights (`--save-weights DIR/w.safetensors`)."""
    return read_f32_safetensors(d + "/w.safetensors")


def median_images_per_s(s):
    """The median throughput of a run's metrics lines after the first two (warm-up)."""
    rest = sorted(r.get("images_per_s", 0) for r in s[2:])
    return rest[len(rest) // 2] if rest else None


def main():
    a, b, label = sys.argv[1], sys.argv[2], sys.argv[3]
    ltol, wtol, world = float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
    sa, sb = steps(a), steps(b)
    la, lb = [r["loss"] for r in sa], [r["loss"] for r in sb]
    loss_rel = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
    wa, wb = weights(a), weights(b)
    w_rel = max(abs(x - y) / (1 + abs(y)) for k in wb for x, y in zip(wa[k], wb[k]))
    h0 = json.load(open(a + "/summary.json"))["weights_hash"]
    hashes_ok = all(json.load(open("%s/rank%d/summary.json" % (a, r)))["weights_hash"] == h0 for r in range(1, world))
    ok = len(la) == len(lb) and loss_rel < ltol and w_rel < wtol and hashes_ok
    print(json.dumps({"check": label, "ok": ok, "steps": len(la), "loss_max_rel": loss_rel, "weights_max_rel": w_rel,
                      "ranks_agree": hashes_ok, "median_images_per_s": [median_images_per_s(sa), median_images_per_s(sb)]}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
