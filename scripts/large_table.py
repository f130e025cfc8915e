"""The large-image table from one scripts/gpu_large.sh call: vitscale against the PyTorch peer
rows of the same call (img/s, MFU with attention FLOPs counted, peak memory, ratios). A peer
that ran with timm's activation checkpointing (scripts/peer_checkpointed.py) says so in its cell."""
import json, os, sys

out = sys.argv[1]
def rows(name):
    p = os.path.join(out, name)
    return [json.loads(l) for l in open(p) if l.startswith("{")] if os.path.exists(p) else []
ours, peer = rows("vitscale.jsonl"), rows("peer.jsonl")
print("| row | model, image | micro | vitscale img/s | MFU | peak GiB | recompute | torch eager | torch.compile | vs eager | vs compile |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for r in ours:
    ps = [p for p in peer if p.get("row") == r["row"]]
    eager = next((p for p in ps if p["mode"] == "torch"), None)
    comp = next((p for p in ps if p["mode"] == "torch+compile"), None)
    cell = lambda p: f"{p['img_per_s']:.0f} ({p['max_mem_gib']:.1f} GiB{', checkpointed' if p.get('checkpointed') else ''})" if p else "–"
    ratio = lambda p: f"{r['img_per_s'] / p['img_per_s']:.2f}×" if p else "–"
    print(f"| {r['row']} | {r['model']} {r['image_size']} px | {r['micro']} | {r['img_per_s']:.0f} | {100 * r['mfu']:.1f}% | {r['peak_mem_gib']:.1f} | {r.get('recompute_policy', '–')} | {cell(eager)} | {cell(comp)} | {ratio(eager)} | {ratio(comp)} |")
