"""Feeds DeepSpeed's own `DynamicLossScaler` (and the static `LossScaler`) sequences of
overflow flags and records the scale after each `update_scale(overflow)`: the reference for
vitscale's `train::loss_scale` state machine (`tests/loss_scale.rs`).

Run from the repository root with DeepSpeed installed (a pure-Python build is enough:
`DS_BUILD_OPS=0`):

    python reference/make_loss_scale_fixture.py tests/fixtures/loss_scale/scaler.json

Each case gives the scaler's arguments as DeepSpeed's engine builds them from the `fp16`
block (`init_scale = 2**initial_scale_power`, `delayed_shift = hysteresis`, ...), the overflow
flags, and after each update: `cur_scale`, `cur_hysteresis`, `last_overflow_iter`, `cur_iter`,
or `"error"` when DeepSpeed raises (overflow with the scale already at its minimum).
"""

import json
import os
import random
import socket
import sys

import deepspeed
import torch
from deepspeed.runtime.fp16 import loss_scaler
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler


def flags(pattern):
    """'o' = overflow, '.' = a finite step."""
    return [c == "o" for c in pattern]


def run_dynamic(args, overflows):
    s = DynamicLossScaler(init_scale=2**args["initial_scale_power"],
                          scale_window=args["loss_scale_window"],
                          min_scale=args["min_loss_scale"],
                          delayed_shift=args["hysteresis"],
                          consecutive_hysteresis=args["consecutive_hysteresis"],
                          dtype=torch.half)
    after = []
    for o in overflows:
        try:
            s.update_scale(o)
        except Exception as e:
            # only DeepSpeed's "cannot decrease scale anymore" is an expected outcome
            if "minimum" not in str(e):
                raise
            after.append({"error": str(e)})
            break
        after.append({
            "cur_scale": float(s.cur_scale),
            "cur_hysteresis": int(s.cur_hysteresis),
            "last_overflow_iter": int(s.last_overflow_iter),
            "cur_iter": int(s.cur_iter),
        })
    return after


def run_static(scale, overflows):
    s = LossScaler(scale=scale)
    out = []
    for o in overflows:
        s.update_scale(o)
        out.append({"cur_scale": float(s.cur_scale)})
    return out


def init_one_rank():
    """The scaler asks `deepspeed.comm.get_rank()` only to decide whether to log. DeepSpeed's
    own process-group setup on a CPU-only machine wants a compiled shared-memory op, so the
    module's `dist` is pointed at torch.distributed over a one-rank gloo group instead (its
    `get_rank()` answers the same 0); the state machine itself is DeepSpeed's, untouched."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(k, v)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    loss_scaler.dist = torch.distributed


def main(out_path):
    init_one_rank()
    def dyn(power=16, window=1000, hyst=2, consecutive=False, min_scale=1.0):
        return {"initial_scale_power": power, "loss_scale_window": window, "hysteresis": hyst,
                "consecutive_hysteresis": consecutive, "min_loss_scale": min_scale}

    rng = random.Random(45)
    cases = [
        ("hysteresis_2_then_halving", dyn(hyst=2), "ooooo....."),
        ("hysteresis_1_halves_at_once", dyn(hyst=1), "ooo.o"),
        ("hysteresis_3_isolated_overflows", dyn(hyst=3), "o..o..o..o..o"),
        ("window_expiry_doubles", dyn(window=3, hyst=2), "..........."),
        ("window_after_overflow", dyn(window=4, hyst=2), "oo.........o........."),
        ("window_refills_hysteresis", dyn(window=3, hyst=2), "o....o.o....oo"),
        ("min_scale_clamps", dyn(power=3, hyst=1, min_scale=2.0), "oo..."),
        ("min_scale_non_power_of_two", dyn(power=4, hyst=1, min_scale=3.0), "ooo"),
        ("min_scale_overflow_raises", dyn(power=2, hyst=1, min_scale=1.0), "oooo"),
        ("min_scale_hysteresis_still_counts", dyn(power=1, hyst=3, min_scale=1.0), "oooo"),
        ("consecutive_on", dyn(window=4, hyst=3, consecutive=True), "oo.oo.ooo......oo"),
        ("consecutive_off", dyn(window=4, hyst=3, consecutive=False), "oo.oo.ooo......oo"),
        ("consecutive_on_window_1", dyn(window=1, hyst=2, consecutive=True), "o..o.oo.."),
        ("window_1", dyn(window=1, hyst=2), "....o..oo.."),
        ("large_power", dyn(power=130, window=1000, hyst=2), "oooooooo.."),
    ]
    for i in range(6):
        n = 60
        pat = "".join("o" if rng.random() < 0.3 else "." for _ in range(n))
        cases.append((f"random_{i}", dyn(power=rng.randint(8, 24), window=rng.randint(1, 6),
                                          hyst=rng.randint(1, 4), consecutive=bool(i % 2),
                                          min_scale=float(2**rng.randint(0, 4))), pat))
    out = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "dynamic": [], "static": []}
    for name, args, pattern in cases:
        out["dynamic"].append({"name": name, "args": args, "overflows": pattern,
                               "after": run_dynamic(args, flags(pattern))})
    for scale, pattern in [(1024.0, "o..o."), (0.5, "..o")]:
        out["static"].append({"loss_scale": scale, "overflows": pattern,
                              "after": run_static(scale, flags(pattern))})
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
