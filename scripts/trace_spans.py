#!/usr/bin/env python3
"""Summarizes Chrome traces written by `vitscale train --trace DIR`: for each track and span name,
how many spans and their durations (median, mean, 90th percentile, largest, in ms), over the
run's middle (the first and last parts of its time left out: warm-up, the final evaluation).
Where the training thread waits shows as long spans on its track ("forward" holds the wait for
a decoded batch); what the device did meanwhile as the "device: compute stream" track's.

    scripts/trace_spans.py TRACE.json [TRACE.json ...] [--skip 0.15] [--tail 0.05]"""
import argparse
import collections
import json
import statistics


def summarize(path, skip, tail):
    doc = json.load(open(path))
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    tracks = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        print(f"{path}: no spans")
        return
    t0 = min(e["ts"] for e in spans)
    length = max(e["ts"] + e.get("dur", 0) for e in spans) - t0
    lo, hi = t0 + skip * length, t0 + (1 - tail) * length
    groups = collections.defaultdict(list)
    for e in spans:
        if lo <= e["ts"] <= hi:
            track = tracks.get((e.get("pid"), e.get("tid")), f"track {e.get('tid')}")
            groups[(e.get("pid"), track, e["name"])].append(e.get("dur", 0) / 1e3)
    print(f"{path}: {len(spans)} spans over {length / 1e3:.0f} ms; from {(lo - t0) / 1e3:.0f} to {(hi - t0) / 1e3:.0f} ms, in ms:")
    print(f"  {'rank':>4}  {'track':<24} {'span':<40} {'n':>5} {'median':>8} {'mean':>8} {'p90':>8} {'max':>8}")
    for (pid, track, name), d in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        d.sort()
        print(f"  {pid:>4}  {track[:24]:<24} {name[:40]:<40} {len(d):>5} {statistics.median(d):8.3f} {statistics.mean(d):8.3f} {d[int(0.9 * (len(d) - 1))]:8.3f} {d[-1]:8.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--skip", type=float, default=0.15, help="share of the run's time left out at its start")
    ap.add_argument("--tail", type=float, default=0.05, help="share of the run's time left out at its end")
    a = ap.parse_args()
    for p in a.traces:
        summarize(p, a.skip, a.tail)


if __name__ == "__main__":
    main()
