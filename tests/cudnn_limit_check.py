"""bench/e2e/cudnn_limit.py on the CPU, at a tiny size (about 25 s on the 2-core VM): each limit runs in a process
of its own with the limit read back from torch, the limits alternate between rounds, the summary is the arithmetic
of the processes' times, and bad arguments are refused by name.

    python tests/cudnn_limit_check.py --out DIR
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "bench", "e2e", "cudnn_limit.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import cudnn_limit  # noqa: E402


def expect(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def refusals():
    for bad in ("10", "10,-1", "10,10", "ten,0", ""):
        try:
            cudnn_limit.parse_limits(bad)
            expect(False, f"--limits {bad!r} accepted")
        except argparse.ArgumentTypeError as e:
            expect("--limits" in str(e) and ">= 0" in str(e), f"message for {bad!r}: {e}")
    expect(cudnn_limit.parse_limits("10,0,1") == [10, 0, 1], "three limits in their order")
    done = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--rounds", "0"], capture_output=True, text=True)
    expect(done.returncode == 2 and "--rounds must be >= 1, got 0" in done.stderr, f"--rounds 0: {done.stderr}")


def run(out):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "cudnn-limit.jsonl")
    if os.path.exists(path):
        os.remove(path)
    # Width 16, not less: with fewer input channels than oneDNN's block (8 with AVX2, 16 with AVX-512), the
    # channels-last backward of the stride-2 1x1 shortcut convolution hangs or crashes in oneDNN (uxlfoundation/oneDNN
    # issue 6035; seen here with width 4: one run in about five hung in jit_avx2_1x1_convolution_bwd_weights).
    done = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--limits", "7,0", "--rounds", "2", "--batch",
                           "2", "--image", "16", "--width", "16", "--warmup", "1", "--steps", "1", "--windows", "3",
                           "--out", path], capture_output=True, text=True, timeout=240)
    expect(done.returncode == 0, f"run failed: {done.stderr[-2000:]}")
    lines = [json.loads(line) for line in open(path)]
    arms, summary = lines[:-1], lines[-1]
    expect([r["limit"] for r in arms] == [7, 0, 0, 7], f"alternated order: {[r['limit'] for r in arms]}")
    for r in arms:
        expect(r["limit_read_back"] == r["limit"], f"torch read back {r['limit_read_back']} for {r['limit']}")
        expect(len(r["step_ms"]) == 3 and all(t > 0 for t in r["step_ms"]), f"three timed windows: {r['step_ms']}")
        expect(r["size"] == {"width": 16, "image": 16, "batch": 2}, f"size overrides: {r['size']}")
        expect(r["device"] == "cpu" and r["amp"] == "off", f"auto amp is off on the CPU: {r}")
    expect(len({r["pid"] for r in arms}) == 4, "one process per arm")
    med = {v: statistics.median([statistics.median(r["step_ms"]) for r in arms if r["limit"] == v]) for v in (7, 0)}
    expect(summary["summary"] and summary["limits"] == [7, 0], f"summary: {summary}")
    expect(abs(summary["median_step_ms"]["0"] - med[0]) < 1e-9, "median of the arms' medians")
    expect(abs(summary["speedup_vs_first"]["0"] - med[7] / med[0]) < 1e-9, "ratio: the first limit's over the other's")
    expect(summary["speedup_vs_first"]["7"] == 1.0, "the baseline against itself")
    expect(summary["first_step_s_max"]["0"] == max(r["first_step_s"] for r in arms if r["limit"] == 0), "first steps")
    expect("limit 0 vs 7: " in done.stdout and "x (" in done.stdout, f"the summary line: {done.stdout}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    refusals()
    run(a.out)
    print("cudnn_limit checks passed")


if __name__ == "__main__":
    main()
