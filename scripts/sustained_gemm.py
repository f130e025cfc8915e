"""What the card's own bf16 GEMM sustains under its power cap: torch's 8192³ product (cuBLAS,
random data) timed cold, then again after 20 s of back-to-back runs. Run beside `vitscale
bench` on the same card to see how much of the card's sustained tensor rate a step reaches
(BENCHMARKS.md, "Training step, one GPU")."""
import time

import torch

a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(a)


def run(n):
    s = torch.cuda.Event(enable_timing=True)
    e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


run(5)
t = run(10)
print(f"cold 8192^3: {2 * 8192**3 / t / 1e9:.0f} TFLOP/s")
t_end = time.time() + 20
while time.time() < t_end:
    r = run(50)
print(f"sustained (after 20 s) 8192^3: {2 * 8192**3 / r / 1e9:.0f} TFLOP/s")
