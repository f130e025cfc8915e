#!/usr/bin/env python3
"""Draws Chrome traces written by `vitscale train --trace DIR` as one picture: a row per track of
each rank, a bar per span, over a window of the run (default: its last steps before the end).

    scripts/trace_png.py OUT.png TRACE.json [TRACE.json ...] [--last-ms 40] [--skip-ms 0]

Needs matplotlib."""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"data": "#8c8c8c", "forward": "#4c78a8", "backward": "#f58518", "wait": "#e45756",
           "clip": "#54a24b", "bookkeeping": "#b279a2", "evaluation": "#dddddd", "group": "#72b7b2",
           "bucket": "#e45756", "all_reduce": "#e45756", "reduce_scatter": "#e45756", "all_gather": "#9d755d"}


def colour(name):
    return COLOURS.get(name.split(" ")[0].split(":")[0], "#bab0ac")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--last-ms", type=float, default=40.0, help="length of the window drawn")
    ap.add_argument("--skip-ms", type=float, default=0.0, help="how far before the last span the window ends")
    a = ap.parse_args()
    rows, spans = [], []
    for path in a.traces:
        events = json.load(open(path))["traceEvents"]
        names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
        for e in events:
            if e.get("ph") != "X":
                continue
            key = (e["pid"], e["tid"])
            label = f"rank {e['pid']}: {names.get(key, e['tid'])}"
            if label not in rows:
                rows.append(label)
            spans.append((label, e["ts"] / 1e3, e["dur"] / 1e3, e["name"]))
    # leave out the evaluation / checkpoint at the end: the window ends at the last training span
    train = [s for s in spans if not s[3].startswith("evaluation")]
    end = max(s[1] + s[2] for s in train) - a.skip_ms
    start = end - a.last_ms
    rows.sort()
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.2))
    for label, ts, dur, name in spans:
        if ts + dur < start or ts > end:
            continue
        y = rows.index(label)
        ax.barh(y, dur, left=ts, height=0.7, color=colour(name), edgecolor="black", linewidth=0.2)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_xlim(start, end)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the run's start (host clock)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ["#8c8c8c", "#4c78a8", "#f58518", "#e45756", "#54a24b", "#b279a2"]]
    ax.legend(handles, ["data", "forward", "backward", "waiting for / reducing gradients", "clip + optimizer", "bookkeeping"], loc="upper left", fontsize=7, ncol=6)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
