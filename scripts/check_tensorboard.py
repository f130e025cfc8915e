#!/usr/bin/env python3
"""Reads a vitscale TensorBoard monitor folder with TensorBoard's own reader and checks it.

usage: check_tensorboard.py DIR EXPECTED_JSON
  DIR            the folder holding events.out.tfevents.* (<output_path>/<job_name>)
  EXPECTED_JSON  {"tag": [[step, value], ...], ...}: every listed scalar must be read back
                 at that step with that value (float32 rounding: 1e-6 relative)

Prints one line per tag and exits 0 when all match; exit 1 with the difference otherwise,
exit 3 when TensorBoard is not installed (`pip install tensorboard`).
"""
import json
import sys

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as e:  # the caller decides whether a missing reader is a failure
    print(f"tensorboard is not installed: {e}", file=sys.stderr)
    sys.exit(3)


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    folder, expected_path = sys.argv[1], sys.argv[2]
    with open(expected_path) as f:
        expected = json.load(f)
    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags().get("scalars", []))
    bad = 0
    for tag, points in expected.items():
        if tag not in tags:
            print(f"{tag}: missing (TensorBoard read {sorted(tags)})")
            bad += 1
            continue
        got = {e.step: e.value for e in acc.Scalars(tag)}
        for step, value in points:
            v = got.get(step)
            if v is None or abs(v - value) > 1e-6 * max(1.0, abs(value)):
                print(f"{tag}: step {step}: expected {value}, read {v}")
                bad += 1
        print(f"{tag}: {len(got)} scalars read, {len(points)} checked")
    if bad:
        print(f"{bad} mismatches")
        return 1
    print("ok: TensorBoard reads every expected scalar")
    return 0


if __name__ == "__main__":
    sys.exit(main())
