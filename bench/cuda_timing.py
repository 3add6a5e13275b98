"""Shared by the Python peers (bench/peer_*.py): median milliseconds of `fn`
per call after warm-up: on CUDA timed with CUDA events, read after one final
sync (median_ms); on the CPU with the host clock (median_ms_on)."""
import statistics
import time

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


def median_ms_on(device, fn, warmup, iters):
    """median_ms on "cuda", host-clock medians on "cpu"."""
    if device == "cuda":
        return median_ms(fn, warmup, iters)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
