"""Side-by-side table of vitscale and the PyTorch peer from one scripts/gpu.sh round."""
import json, sys, os

out = sys.argv[1]
env = open(os.path.join(out, "env.txt")).read().strip().splitlines()
def rows(name):
    p = os.path.join(out, name)
    return [json.loads(l) for l in open(p) if l.startswith("{")] if os.path.exists(p) else []
ours, peer = rows("vitscale.jsonl"), rows("peer.jsonl")

def key_ours(r):
    return ("cifar" if r["image_size"] == 32 else "b16", r["micro"])
def key_peer(r):
    return ("cifar" if r["img"] == 32 else "b16", r["micro"])

print("\n".join("- " + e for e in env))
print()
print("| model | micro | vitscale img/s | step ms | MFU | SM MHz (power-capped) | graph | recompute | peak GiB | peer | peer img/s | peer GiB | ratio |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

def clock(p):
    """Mean SM clock and the share of NVML samples at the power cap (vitscale bench's telemetry)."""
    return f"{p['sm_mhz_mean']:.0f} ({100 * p['power_capped']:.0f} %)" if p else "–"
for r in ours:
    k = key_ours(r)
    ps = [p for p in peer if key_peer(p) == k] or [None]
    for p in ps:
        name = "ViT-S/4 32px" if k[0] == "cifar" else "ViT-B/16 224"
        pc = f"{p['mode']}" if p else "–"
        pi = f"{p['img_per_s']:.0f}" if p else "–"
        pm = f"{p['max_mem_gib']:.2f}" if p else "–"
        ratio = f"{r['img_per_s'] / p['img_per_s']:.2f}×" if p else "–"
        print(f"| {name} | {r['micro']} | {r['img_per_s']:.0f} | {r['step_ms']:.2f} | {100*r['mfu']:.1f}% | {clock(r.get('gpu_power'))} | {r['graph']} | {r.get('recomputed', False)} | {r['peak_mem_gib']:.2f} | {pc} | {pi} | {pm} | {ratio} |")
print()
ceil = [r for r in ours if r["ceiling_tflops"]]
if ceil:
    best = max(ceil, key=lambda r: r["ceiling_tflops"])
    at = f" at SM {clock(best.get('ceiling_gpu_power'))}" if best.get("ceiling_gpu_power") else ""
    print(f"Measured bf16 GEMM ceiling (cuBLASLt 8192³, random data): {best['ceiling_tflops']:.0f} TFLOP/s{at}.")
