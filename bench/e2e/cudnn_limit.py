"""cuDNN's autotuner limit (torch.backends.cudnn.benchmark_limit, perf::Settings::cudnn_benchmark_limit), A/B on
the e2e CNN's training step with bench/e2e's recipe (TF32, cuDNN benchmark, channels-last, bf16 autocast, fused
AdamW), before anyone changes perf's default.

LibTorch times only the first 10 of cuDNN's candidate plans per convolution by default (Conv_v8.cpp,
get_plans_from_find); 0 times all of them. Each limit runs in its own process (the autotuner's choices are cached
per process), the limits alternated over --rounds, and the summary gives each limit's median step against the
first limit's, with the first step's time (where the search happens):

    python bench/e2e/cudnn_limit.py --device cuda --limits 10,0 --rounds 2 [--out runs.jsonl]

On the CPU it runs the same way at the job's CPU size (cuDNN is not used: the ratio is noise), which is how its
test checks the plumbing."""
import argparse
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import time


def parse_limits(text):
    try:
        limits = [int(v) for v in text.split(",")]
    except ValueError:
        limits = []
    if len(limits) < 2 or any(v < 0 for v in limits) or len(set(limits)) != len(limits):
        raise argparse.ArgumentTypeError(
            f"--limits: two or more different integers >= 0, comma-separated (0: every plan), got {text!r}")
    return limits


def arm(a):
    """One limit in this process: the step's times, as one JSON line on stdout."""
    import torch  # here, not above: the process that starts the arms does not need it
    import torch.nn.functional as F

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import models
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("cudnn_limit.py: --device cuda, but torch sees no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.benchmark_limit = a.limit
    size = dict(models.JOBS["cnn"]["cuda" if cuda else "cpu"])
    for key in ("batch", "image", "width"):
        if getattr(a, key):
            size[key] = getattr(a, key)
    torch.manual_seed(0)
    model = models.make("cnn", size).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=cuda or None)
    x, y = models.make_data("cnn", size, size["batch"])
    x = x.to(dev).contiguous(memory_format=torch.channels_last)
    y = y.to(dev)
    amp = a.amp == "bf16" or (a.amp == "auto" and cuda)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        opt.step()

    t = time.perf_counter()
    step()
    sync()
    first_s = time.perf_counter() - t
    for _ in range(a.warmup):
        step()
    sync()
    step_ms = []
    for _ in range(a.windows):
        t = time.perf_counter()
        for _ in range(a.steps):
            step()
        sync()
        step_ms.append((time.perf_counter() - t) * 1e3 / a.steps)
    print(json.dumps({"limit": a.limit, "limit_read_back": torch.backends.cudnn.benchmark_limit,
                      "pid": os.getpid(), "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "cudnn": torch.backends.cudnn.version(), "torch": torch.__version__, "size": size,
                      "amp": "bf16" if amp else "off", "first_step_s": first_s, "step_ms": step_ms}))


def die_with_parent():
    """In an arm, before it starts: killed when the process that started it dies (a timeout's kill of that one
    leaves no arm running on; Linux's PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass


def summarize(results, limits):
    """Per limit: the median of its processes' median steps, and the ratio of the first limit's to it (> 1: faster
    than the first limit)."""
    med = {v: statistics.median(statistics.median(r["step_ms"]) for r in results if r["limit"] == v) for v in limits}
    first = {v: max(r["first_step_s"] for r in results if r["limit"] == v) for v in limits}
    return {"summary": True, "limits": limits,
            "median_step_ms": {str(v): med[v] for v in limits},
            "speedup_vs_first": {str(v): med[limits[0]] / med[v] for v in limits},
            "first_step_s_max": {str(v): first[v] for v in limits}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--limits", type=parse_limits, default=[10, 0], help="comma-separated, the first is the baseline")
    p.add_argument("--rounds", type=int, default=2, help="processes per limit, alternated")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="steps per timed window")
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "off"], help="auto: bf16 on CUDA, off on CPU")
    p.add_argument("--batch", type=int, default=0, help="overrides the job's size (0: models.JOBS)")
    p.add_argument("--image", type=int, default=0)
    p.add_argument("--width", type=int, default=0)
    p.add_argument("--out", help="JSON lines, appended: one per process as it ends, then the summary")
    p.add_argument("--limit", type=int, help=argparse.SUPPRESS)  # set in the processes this one starts
    a = p.parse_args()
    for name in ("rounds", "steps", "windows"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.limit is not None:
        arm(a)
        return
    args = sys.argv[1:]
    results = []
    for r in range(a.rounds):
        order = a.limits if r % 2 == 0 else list(reversed(a.limits))
        for limit in order:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--limit", str(limit)],
                                  capture_output=True, text=True, preexec_fn=die_with_parent)
            if done.returncode != 0:
                raise SystemExit(f"cudnn_limit.py: the process for limit {limit} failed ({done.returncode}):\n"
                                 f"{done.stderr[-3000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            got = results[-1]
            if a.out:  # each process's line as it ends: a run stopped by a timeout keeps what it measured
                with open(a.out, "a") as f:
                    f.write(json.dumps(got) + "\n")
            print(f"limit {limit:>3}: median step {statistics.median(got['step_ms']):.3f} ms, first step "
                  f"{got['first_step_s']:.2f} s (round {r + 1})", flush=True)
    summary = summarize(results, a.limits)
    base = a.limits[0]
    for v in a.limits[1:]:
        print(f"limit {v} vs {base}: {summary['speedup_vs_first'][str(v)]:.3f}x "
              f"({summary['median_step_ms'][str(v)]:.3f} vs {summary['median_step_ms'][str(base)]:.3f} ms a step; "
              f"first step up to {summary['first_step_s_max'][str(v)]:.1f} vs "
              f"{summary['first_step_s_max'][str(base)]:.1f} s) on {results[0]['device']}, cuDNN "
              f"{results[0]['cudnn']}")
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
