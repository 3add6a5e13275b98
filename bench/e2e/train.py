"""One end-to-end training run in Python (one job, one configuration), appending
one JSON line to --out. bench/e2e/run.py calls it; e2e.cpp is the C++ side.

Configurations: eager_fp32 (PyTorch defaults); eager_recipe (the seeds' recipe:
TF32 + cuDNN benchmark, bf16 autocast where the C++ side uses it, channels-last
for the CNN, fused AdamW, pinned multi-worker DataLoader on CUDA; run.py starts
the recipe runs with glibc malloc's cache settings in the environment, what
perf::setup()'s cpu_malloc_cache sets from C++); compile_recipe
(the recipe + torch.compile(model)); compile_max_autotune and
compile_reduce_overhead (the recipe + those torch.compile modes)."""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

CONFIGS = ["eager_fp32", "eager_recipe", "compile_recipe", "compile_max_autotune", "compile_reduce_overhead"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True, choices=list(models.JOBS))
    p.add_argument("--config", required=True, choices=CONFIGS)
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", required=True, help="JSON sizes (models.JOBS)")
    p.add_argument("--data", required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--amp", default="off", choices=["off", "bf16"])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="steps after the timed ones traced by torch.profiler into --profile (not timed, losses not kept)")
    p.add_argument("--profile", help="where --profile-steps' trace goes (Chrome trace JSON)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.profile_steps < 0 or (a.profile_steps and not a.profile):
        p.error(f"--profile-steps must be >= 0 and needs --profile PATH, got {a.profile_steps} and {a.profile!r}")

    size = json.loads(a.size)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    recipe = a.config != "eager_fp32"
    if recipe:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")
    model = models.make(a.job, size)
    model.load_state_dict(torch.load(a.init))
    model.to(dev)
    channels_last = recipe and a.job == "cnn"
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True if recipe else None)
    data = torch.load(a.data)
    workers = 2 if (recipe and cuda) else 0
    loader = DataLoader(TensorDataset(data["x"], data["y"]), batch_size=size["batch"], shuffle=False, drop_last=True,
                        num_workers=workers, pin_memory=recipe and cuda, persistent_workers=workers > 0)
    forward = model
    if a.config == "compile_recipe":
        forward = torch.compile(model)
    elif a.config == "compile_max_autotune":
        forward = torch.compile(model, mode="max-autotune")
    elif a.config == "compile_reduce_overhead":
        forward = torch.compile(model, mode="reduce-overhead")
    amp = recipe and a.amp == "bf16"

    def step(xb, yb):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            out = forward(xb)
        loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), yb.reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def batches():  # the data set's batches on the device, epoch after epoch
        while True:
            for xb, yb in loader:
                xb = xb.to(dev, non_blocking=True)
                yb = yb.to(dev, non_blocking=True)
                if channels_last:
                    xb = xb.contiguous(memory_format=torch.channels_last)
                yield xb, yb

    total = a.warmup + a.steps
    losses, marks = [], []
    first_step_s = None
    done = 0
    t_start = time.perf_counter()
    feed = batches()
    for xb, yb in feed:
        losses.append(step(xb, yb))
        done += 1
        if done == 1:
            sync()
            first_step_s = time.perf_counter() - t_start
        if done >= a.warmup and (done - a.warmup) % a.window == 0:
            sync()
            marks.append(time.perf_counter())
        if done == total:
            break
    windows = [(marks[i + 1] - marks[i]) for i in range(len(marks) - 1)]
    per_s = sorted(a.window * size["batch"] / w for w in windows)
    result = {
        "lang": "python", "job": a.job, "config": a.config, "device": a.device,
        "samples_per_s": per_s[len(per_s) // 2] if per_s else None, "windows_samples_per_s": per_s,
        "losses": torch.stack(losses).float().cpu().tolist(), "first_step_s": first_step_s,
        "batch": size["batch"], "warmup": a.warmup, "steps": a.steps, "threads": torch.get_num_threads(),
        "amp": "bf16" if amp else "off", "torch": torch.__version__,
    }
    with open(a.out, "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"python {a.job} {a.config}: {result['samples_per_s']:.1f} samples/s, final loss {result['losses'][-1]:.4f}, "
          f"first step {first_step_s:.2f} s", flush=True)
    if a.profile_steps:
        # As e2e.cpp: after the result is written, more steps in one "e2e_profiled_steps" range that ends after
        # a sync (trace_table.py). A profiler that fails costs the run only its profile.
        sync()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        try:
            with torch.profiler.profile(activities=activities) as prof:
                with torch.profiler.record_function("e2e_profiled_steps"):
                    for _, (xb, yb) in zip(range(a.profile_steps), feed):
                        step(xb, yb)
                    sync()
            prof.export_chrome_trace(a.profile)
        except Exception as e:  # noqa: BLE001  (said; the timings stand)
            print(f"train.py: no profile: {type(e).__name__}: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
