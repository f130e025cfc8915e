#!/usr/bin/env python3
"""The memory part of the ZeRO GPU checks (gpu_zero_check.sh, gpu_zero3_check.sh): reads the
"memory" record of every run OUT/mem_w{N}_s{S} (rank 0's and each rankR/ directory's) and checks,
at 2 and 4 ranks, that the measured peak drops from stage FROM to each stage in TO by the
predicted drop within 10 %. Writes {"rows", "drops"} to OUT/NAME, prints one JSON line per rank
and run, then the check's line; exits 1 when a drop is off or a run is missing.

    memory_drops.py OUT FROM TO[,TO…] NAME
"""
import json
import os
import sys

GIB = 2**30


def record(d):
    for line in open(d + "/metrics.jsonl"):
        r = json.loads(line)
        if r.get("kind") == "memory":
            return r
    raise SystemExit("no memory record in " + d)


def main():
    out, base, targets, name = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")], sys.argv[4]
    rows, ok = [], True
    for n in (1, 2, 4):
        for s in [base] + targets:
            d = "%s/mem_w%d_s%d" % (out, n, s)
            if not os.path.isdir(d):
                continue
            for r in range(n):
                rec = record(d if r == 0 else "%s/rank%d" % (d, r))
                rows.append({"world": n, "stage": s, "rank": r, "accounted_gib": rec["accounted"]["total"] / GIB,
                             "predicted_gib": rec["predicted"]["total"] / GIB, "measured_peak_gib": (rec["measured_peak"] or 0) / GIB,
                             "accounted": {k: v / GIB for k, v in rec["accounted"].items()},
                             "predicted": {k: v / GIB for k, v in rec["predicted"].items()}})

    def most(key, n, s):
        v = [r[key] for r in rows if r["world"] == n and r["stage"] == s]
        return max(v) if v else None

    checks = []
    for n in (2, 4):
        for s in targets:
            if most("measured_peak_gib", n, base) is None or most("measured_peak_gib", n, s) is None:
                ok = False
                continue
            drop_m = most("measured_peak_gib", n, base) - most("measured_peak_gib", n, s)
            drop_p = most("predicted_gib", n, base) - most("predicted_gib", n, s)
            good = drop_p > 0 and abs(drop_m - drop_p) <= 0.1 * drop_p
            ok &= good
            checks.append({"world": n, "stage": s, "measured_drop_gib": drop_m, "predicted_drop_gib": drop_p, "ok": good})
    json.dump({"rows": rows, "drops": checks}, open(os.path.join(out, name), "w"), indent=1)
    for r in rows:
        print(json.dumps(r))
    label = "memory drop stage %d -> %s within 10%% of the prediction" % (base, "/".join(map(str, targets)))
    print(json.dumps({"check": label, "ok": ok, "drops": checks}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
