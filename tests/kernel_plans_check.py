"""bench/e2e/kernel_plans.py: its comparison rule on hand-made totals, then the e2e CNN's bf16 channels-last
training step (the recipe bench/e2e runs on CUDA, batch 2) planned for a simulated H100 both ways: perf's
package may not plan other extern kernels than torch.compile, nor its convolution backwards in other layouts,
nor more than 15% more fused kernels or bytes.
Alone, in one process:

    python tests/kernel_plans_check.py

ctest plans the two sides in two processes at once (each about half the time) and compares them afterwards:

    python tests/kernel_plans_check.py --side perf --out DIR      # e2e_kernel_plans_perf
    python tests/kernel_plans_check.py --side compile --out DIR   # e2e_kernel_plans_compile
    python tests/kernel_plans_check.py --compare DIR              # e2e_kernel_plans, after both
"""
import argparse
import collections
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench", "e2e"))
import kernel_plans  # noqa: E402


def expect(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def totals(fused, nbytes, conv_backward="channels-last", **extern):
    return {"fused": fused, "bytes": nbytes, "extern": collections.Counter(extern),
            "conv_backward": collections.Counter({conv_backward: extern.get("convolution", 0)})}


def the_rule():
    same = totals(10, 1000, convolution=2, mm=1)
    expect(kernel_plans.check(same, totals(10, 1000, convolution=2, mm=1), 0.15) == [], "equal plans pass")
    expect(kernel_plans.check(totals(11, 1100, convolution=2, mm=1), same, 0.15) == [], "10% more passes at 15%")
    expect(kernel_plans.check(totals(5, 500, convolution=2, mm=1), same, 0.0) == [], "less always passes")
    more = kernel_plans.check(totals(12, 1200, convolution=2, mm=1), same, 0.15)
    expect(len(more) == 2 and more[0].startswith("fused kernels: perf 12, torch.compile 10 (allowed 15% more)")
           and more[1].startswith("bytes read + written: perf 1200"), f"20% more is named: {more}")
    other = kernel_plans.check(totals(10, 1000, convolution=2, mm=1, copy_=1), same, 0.15)
    expect(len(other) == 1 and other[0].startswith("extern kernels differ"), f"another extern kernel: {other}")
    nchw = kernel_plans.check(totals(10, 1000, "NCHW", convolution=2, mm=1), same, 0.15)
    expect(nchw == ["convolution backwards take other layouts: perf {'NCHW': 2}, torch.compile {'channels-last': 2}"],
           f"backward convolutions in another layout: {nchw}")


STEP = ["--job", "cnn", "--amp", "bf16", "--layout", "channels-last", "--batch", "2"]


def planned(argv, failure):
    try:
        kernel_plans.main(argv)
    except SystemExit as stop:
        expect(not stop.code, failure)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["perf", "compile"], help="plan this side only, into --out")
    parser.add_argument("--out", help="the folder of the sides' plans (--side, --compare)")
    parser.add_argument("--compare", metavar="DIR", help="compare the plans the two --side runs left in DIR")
    a = parser.parse_args()
    if a.side and not a.out:
        parser.error("--side needs --out DIR")
    if a.side and a.compare:
        parser.error("--side plans, --compare reads plans: use one of them")
    if not a.side:
        the_rule()
    if not torch.backends.cudnn.is_available():
        print("skipped: this torch has no cuDNN, so no fake convolution takes its layout")
        return
    failure = "perf's plan of the CNN step does more than torch.compile's (above)"
    if a.side:
        os.makedirs(a.out, exist_ok=True)
        saved = os.path.join(a.out, f"{a.side}.json")
        if os.path.exists(saved):
            os.remove(saved)  # a failed run leaves no plans of an earlier one behind
        planned(STEP + ["--side", a.side, "--save", saved], f"planning the {a.side} side failed (above)")
        print(f"kernel_plans: the {a.side} side planned into {saved}")
    elif a.compare:
        sides = [os.path.join(a.compare, f"{side}.json") for side in ("perf", "compile")]
        missing = [path for path in sides if not os.path.exists(path)]
        expect(not missing, f"no plans in {missing}: run --side perf and --side compile with --out {a.compare} first")
        planned(["--load", sides[0], "--load", sides[1], "--check", "0.15"], failure)
        for path in sides:  # each graph's peak buffer memory, Inductor's estimate: some bytes, below 1 TB
            with open(path) as f:
                for label, plans in json.load(f)["plans"].items():
                    peaks = [p.get("peak", 0) for p in plans]
                    expect(plans and all(0 < peak < 1e12 for peak in peaks), f"{label}: peak estimates {peaks}")
        print("kernel_plans: the rule, and the CNN step's plans, checked")
    else:
        planned(STEP + ["--check", "0.15"], failure)
        print("kernel_plans: the rule, and the CNN step's plans, checked")


if __name__ == "__main__":
    main()
