"""Peer baseline: timm ViT training throughput with PyTorch eager/compile, DDP and DeepSpeed.

Synthetic data resident on the GPU (measures the training step, not the loader).
Run: torchrun --nproc-per-node N vit_bench.py --mode {torch,ddp,deepspeed} [--zero S] [--compile]
Several ranks on ONE GPU (NCCL's Socket transport between emulated nodes, see hostid.sh):
  torchrun --nproc-per-node 2 --no-python ./hostid.sh python3 vit_bench.py --mode ddp --one-gpu
Prints one JSON line per (micro batch, grad accumulation) point, rank 0 only.
"""
import argparse, json, os, time
import torch, torch.nn as nn
import timm

p = argparse.ArgumentParser()
p.add_argument("--mode", default="torch")
p.add_argument("--model", default="vit_base_patch16_224")
p.add_argument("--img", type=int, default=224)
p.add_argument("--classes", type=int, default=10)
p.add_argument("--micro", default="32,64,128,256")
p.add_argument("--gas", default="1")
p.add_argument("--zero", type=int, default=0)
p.add_argument("--compile", action="store_true")
p.add_argument("--steps", type=int, default=30)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--patch", type=int, default=0)
p.add_argument("--half", default="bf16", choices=["bf16", "fp16"], help="16-bit format: bf16, or fp16 with loss scaling (DeepSpeed's fp16 block; torch.amp.GradScaler)")
p.add_argument("--one-gpu", action="store_true", help="every rank on cuda:0 (needs NCCL_HOSTID per rank: hostid.sh)")
a = p.parse_args()

rank = int(os.environ.get("RANK", 0)); world = int(os.environ.get("WORLD_SIZE", 1)); local = int(os.environ.get("LOCAL_RANK", 0))
gpu = 0 if a.one_gpu else local
torch.cuda.set_device(gpu)
dev = torch.device("cuda", gpu)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
if world > 1 and a.mode == "ddp":
    torch.distributed.init_process_group("nccl", device_id=dev)
if a.mode == "deepspeed":
    import deepspeed
    deepspeed.init_distributed("nccl")

def make_model():
    kw = dict(num_classes=a.classes, img_size=a.img)
    if a.patch: kw["patch_size"] = a.patch
    torch.manual_seed(0)
    return timm.create_model(a.model, **kw).to(dev)

half = torch.float16 if a.half == "fp16" else torch.bfloat16

def run(micro, gas):
    model = make_model()
    nparams = sum(p.numel() for p in model.parameters())
    lossf = nn.CrossEntropyLoss()
    x = torch.randn(micro, 3, a.img, a.img, device=dev)
    y = torch.randint(0, a.classes, (micro,), device=dev)
    if a.mode == "deepspeed":
        cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
               a.half: {"enabled": True}, "zero_optimization": {"stage": a.zero},
               "gradient_clipping": 1.0, "steps_per_print": 10**9, "wall_clock_breakdown": False}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=True)
        eng, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        def step():
            for _ in range(gas):
                loss = lossf(eng(x.to(half)), y)
                eng.backward(loss); eng.step()
            return loss
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=True)
        m = model
        if a.mode == "ddp" and world > 1:
            m = nn.parallel.DistributedDataParallel(model, device_ids=[gpu], gradient_as_bucket_view=True)
        fwd = torch.compile(m) if a.compile else m
        import contextlib
        scaler = torch.amp.GradScaler("cuda", enabled=a.half == "fp16")
        def step():
            for i in range(gas):
                ctx = m.no_sync() if (a.mode == "ddp" and world > 1 and i < gas - 1) else contextlib.nullcontext()
                with ctx:
                    with torch.autocast("cuda", dtype=half):
                        loss = lossf(fwd(x), y) / gas
                    scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)
            return loss
    for _ in range(a.warmup): step()
    torch.cuda.synchronize()
    if world > 1: torch.distributed.barrier()
    t = time.perf_counter()
    for _ in range(a.steps): loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / a.steps
    imgs = micro * gas * world
    mem = torch.cuda.max_memory_allocated(dev) / 2**30
    if rank == 0:
        print(json.dumps({"mode": a.mode + ("+compile" if a.compile else "") + (f"+z{a.zero}" if a.mode == "deepspeed" else "") + ("+fp16" if a.half == "fp16" else ""),
                          "model": a.model, "img": a.img, "params": nparams, "world": world, "micro": micro, "gas": gas,
                          "one_gpu": a.one_gpu, "step_ms": round(dt * 1e3, 2), "img_per_s": round(imgs / dt, 1), "img_per_s_per_gpu": round(imgs / dt / world, 1),
                          "max_mem_gib": round(mem, 2), "loss": round(float(loss), 4)}), flush=True)
    del model
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(dev)

for g in [int(v) for v in a.gas.split(",")]:
    for mb in [int(v) for v in a.micro.split(",")]:
        run(mb, g)
if world > 1 and torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
