"""Python peer of bench_compiled.cpp: the same ResNet-style CNN (bench/resnet.py,
twin of bench/resnet.h) at the same batch sizes, inference, in Python: eager fp32
and torch.compile (default, mode="max-autotune" unless --no-max-autotune, and on CUDA
mode="reduce-overhead"). Medians per call (CUDA
events on a GPU), one JSON line per configuration appended to --json.

    python bench/peer_compiled.py --device cpu --width 32 --image 64 --batches 1 32 --json out.jsonl

--compile-only compiles every mode at every batch, in the order a timed run does, and measures nothing: Inductor's
caches (its compiled graphs, max-autotune's choices) then hold them, and a timed run started afterwards on the
same machine takes them from there. scripts/gpu-check.sh starts it beside the build, where max-autotune's minutes
of compilation cost no benchmark time.
"""
import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cuda_timing import median_ms_on  # noqa: E402
from resnet import make_resnet  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--no-max-autotune", action="store_true",
                   help="skip max-autotune (minutes to compile on CUDA; on a 2-core CPU it took 8-11 s per batch)")
    p.add_argument("--json", help="file to append one JSON line per configuration to (required unless --compile-only)")
    p.add_argument("--compile-only", action="store_true",
                   help="compile each mode at each batch into Inductor's caches, measure and write nothing")
    a = p.parse_args()
    if not a.json and not a.compile_only:
        p.error("--json is required (unless --compile-only)")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("peer_compiled: --device cuda but torch.cuda.is_available() is False")
    torch.manual_seed(0)
    model = make_resnet(a.width).to(a.device).eval()
    modes = [("torch.compile default", {})]
    if a.device == "cuda":
        modes.append(("torch.compile reduce-overhead", {"mode": "reduce-overhead"}))
    if not a.no_max_autotune:
        modes.append(("torch.compile max-autotune", {"mode": "max-autotune"}))
    compiled = {name: torch.compile(model, **kw) for name, kw in modes}
    # The same calls in the same order with --compile-only: torch.compile's recompilation for the second batch
    # (dynamic batch) depends on what the code object saw before, and Inductor's cache keys on the graphs.
    with open(a.json or os.devnull, "a") as out:
        for batch in a.batches:
            x = torch.randn(batch, 3, a.image, a.image, device=a.device)
            with torch.inference_mode():
                # Each row is written as soon as it is measured, each mode right after its compilation: a run
                # stopped in a long one (max-autotune on CUDA, minutes) keeps the rows before it.
                for name, fn in [("eager fp32", model)] + list(compiled.items()):
                    if name in compiled:
                        started = time.time()
                        fn(x)  # compiles here, for this shape
                        print(f"{name}, batch {batch}: compiled in {time.time() - started:.0f} s", flush=True)
                    if a.compile_only:
                        continue
                    name = f"Python {name}"
                    ms = median_ms_on(a.device, lambda fn=fn: fn(x), 5, a.iters)
                    print(f"{a.device} batch {batch} {name}: {ms:.3f} ms", flush=True)
                    out.write(json.dumps({"lang": "python", "config": name, "device": a.device, "batch": batch,
                                          "median_ms": ms, "torch": torch.__version__}) + "\n")
                    out.flush()


if __name__ == "__main__":
    main()
