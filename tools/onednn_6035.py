#!/usr/bin/env python3
"""Checks the LibTorch at hand for uxlfoundation/oneDNN#6035, the bug perf::to_channels_last warns about.

oneDNN (3.10.2 in LibTorch 2.11) computes the weight gradient of a strided 1x1 convolution wrongly on an x86 CPU
when the convolution's input is channels-last and it has fewer input channels than oneDNN's block (8 with AVX2, 16
with AVX-512): it hangs, crashes or returns wrong numbers. perf warns where its conditions hold
(perf::detail::onednn_1x1_hazards). Run this after a LibTorch upgrade: where every "hazard" case comes out right at
one and at two threads, the bug is fixed there and the warning can go; a "safe" case that fails means the warning
misses a case.

    python tools/onednn_6035.py                 # every case, each in a process of its own, at 1 and 2 threads
    python tools/onednn_6035.py --cases safe    # the cases perf does not warn about, in one process (what CI runs)

Each case trains one convolution for --steps steps and compares its weight gradient with a float64 reference on
the same input. A case prints "ok", "WRONG" (relative error over 1e-4), "crashed (...)" or "hung (...)". The exit
status is 1 when a safe case did not come out ok, else 0: the hazard cases report, they do not fail.
"""
import argparse
import os
import signal
import subprocess
import sys

# name: (Conv2d arguments, input channels-last, weight channels-last, weight trainable). The input channels come from
# the block (in_channels None: half the block; "block": the block itself).
HAZARD = {
    "channels-last": (dict(in_channels=None, stride=2), True, True, True),
    "input-only-channels-last": (dict(in_channels=None, stride=2), True, False, True),
    "stride-2x1": (dict(in_channels=None, stride=(2, 1)), True, True, True),
}
SAFE = {
    "contiguous": (dict(in_channels=None, stride=2), False, False, True),
    "stride-1": (dict(in_channels=None, stride=1), True, True, True),
    "padded": (dict(in_channels=None, stride=2, padding=1), True, True, True),
    "grouped": (dict(in_channels="block", stride=2, groups=2), True, True, True),
    "as-wide-as-the-block": (dict(in_channels="block", stride=2), True, True, True),
    "frozen-weight": (dict(in_channels=None, stride=2), True, True, False),
}


def block():
    import torch

    return {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 0)


def run_case(name, threads, steps):
    """Trains the case's convolution; returns the worst relative error of its weight (or input) gradient."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    args, input_cl, weight_cl, trainable = {**HAZARD, **SAFE}[name]
    args = dict(args)
    b = block() or 8
    args["in_channels"] = b if args["in_channels"] == "block" else b // 2
    conv = torch.nn.Conv2d(out_channels=8, kernel_size=1, bias=False, **args)
    if weight_cl:
        conv = conv.to(memory_format=torch.channels_last)
    conv.weight.requires_grad_(trainable)
    x = torch.randn(32, args["in_channels"], 32, 32)
    if input_cl:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(not trainable)  # a frozen weight: the input's gradient is the one computed

    w64 = conv.weight.detach().double().requires_grad_(trainable)
    x64 = x.detach().double().requires_grad_(not trainable)
    kw = dict(stride=conv.stride, padding=conv.padding, groups=conv.groups)
    torch.nn.functional.conv2d(x64, w64, **kw).square().sum().backward()
    want = w64.grad if trainable else x64.grad
    worst = 0.0
    for _ in range(steps):
        conv.weight.grad, x.grad = None, None
        conv(x).square().sum().backward()
        got = conv.weight.grad if trainable else x.grad
        worst = max(worst, ((got.double() - want).abs().max() / want.abs().max()).item())
    return worst


def verdict(err):
    return ("ok" if err <= 1e-4 else "WRONG") + f" (relative error {err:.1e})"


def in_subprocess(name, threads, steps, timeout):
    cmd = [sys.executable, __file__, "--one", name, "--threads", str(threads), "--steps", str(steps)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"hung (killed after {timeout:g} s)"
    if done.returncode < 0:
        return f"crashed ({signal.Signals(-done.returncode).name})"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"crashed (exit {done.returncode}: {tail})"
    return lines[-1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", choices=["all", "hazard", "safe"], default="all")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout", type=float, default=60, help="seconds a hazard case may take (default 60)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.steps < 1:
        p.error(f"--steps must be at least 1, got {a.steps}")
    try:
        threads = [int(t) for t in a.threads.split(",")]
    except ValueError:
        threads = []
    if not threads or min(threads) < 1:
        p.error(f"--threads takes thread counts of at least 1, comma-separated, got {a.threads!r}")
    if a.one:
        print(verdict(run_case(a.one, threads[0], a.steps)), flush=True)
        return 0

    import torch

    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"oneDNN's block {block() or 'unknown (the bug is known on AVX2 and AVX-512)'}; "
          f"oneDNN enabled: {torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled}")
    failed = []
    for t in threads:
        if a.cases in ("all", "safe"):  # in this process: a crash here is a failure anyway
            for name in SAFE:
                line = verdict(run_case(name, t, a.steps))
                print(f"safe    {name:26} threads {t}: {line}", flush=True)
                if not line.startswith("ok"):
                    failed.append(f"{name} at {t} threads")
        if a.cases in ("all", "hazard"):
            for name in HAZARD:
                line = in_subprocess(name, t, a.steps, a.timeout)
                print(f"hazard  {name:26} threads {t}: {line}", flush=True)
    if failed:
        print("onednn_6035: safe cases that did not come out right, which perf does not warn about: "
              + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
