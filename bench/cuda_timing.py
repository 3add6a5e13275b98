"""Shared by the Python peers (bench/peer_*.py): median milliseconds of `fn`
per call, timed with CUDA events after warm-up, read after one final sync."""
import statistics

import torch


def median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times)
