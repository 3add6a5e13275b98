"""bench/e2e/kernel_plans.py: its comparison rule on hand-made totals, then the e2e CNN's bf16 channels-last
training step (the recipe bench/e2e runs on CUDA, batch 2) planned for a simulated H100 both ways: perf's
package may not plan other extern kernels than torch.compile, nor its convolution backwards in other layouts,
nor more than 15% more fused kernels or bytes.
Run by ctest (e2e_kernel_plans):

    python tests/kernel_plans_check.py
"""
import collections
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


def main():
    the_rule()
    if not torch.backends.cudnn.is_available():
        print("skipped: this torch has no cuDNN, so no fake convolution takes its layout")
        return
    try:
        kernel_plans.main(["--job", "cnn", "--amp", "bf16", "--layout", "channels-last", "--batch", "2",
                           "--check", "0.15"])
    except SystemExit as stop:
        expect(not stop.code, "perf's plan of the CNN step does more than torch.compile's (above)")
    print("kernel_plans: the rule, and the CNN step's plans, checked")


if __name__ == "__main__":
    main()
