"""Python peer of bench_optim.cpp: torch.optim AdamW / Adam / SGD(momentum) with
fused=True and the default (foreach) on the same ResNet-50 parameter set, CUDA
events, medians, plus the 1 GiB copy_ bandwidth, so the C++ figures can be read
against Python's best in the same session.
Run: python bench/peer_optim.py [--iters 20] (needs a GPU)."""
import argparse

import torch
from cuda_timing import median_ms


def resnet50_shapes():
    s = [(64, 3, 7, 7), (64,), (64,)]

    def conv_bn(out, inp, k):
        s.extend([(out, inp, k, k), (out,), (out,)])

    inp = 64
    for layer, blocks in enumerate((3, 4, 6, 3)):
        width = 64 << layer
        out = width * 4
        for b in range(blocks):
            conv_bn(width, inp, 1)
            conv_bn(width, width, 3)
            conv_bn(out, width, 1)
            if b == 0:
                conv_bn(out, inp, 1)
            inp = out
    s.extend([(1000, 2048), (1000,)])
    return s


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("peer_optim: no CUDA device")
        return
    torch.manual_seed(0)
    params = []
    for shape in resnet50_shapes():
        t = torch.randn(shape, device="cuda", requires_grad=True)
        t.grad = torch.randn(shape, device="cuda")
        params.append(t)
    numel = sum(t.numel() for t in params)
    src = torch.empty(256 << 20, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.nbytes / (median_ms(lambda: dst.copy_(src), 2, 10) * 1e6)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; {len(params)} tensors, {numel} parameters")
    print(f"copy bandwidth (1 GiB copy_, read+write): {copy_gbs:.1f} GB/s")
    rows = [
        ("AdamW", lambda f: torch.optim.AdamW(params, lr=1e-3, fused=f), 7),
        ("Adam", lambda f: torch.optim.Adam(params, lr=1e-3, fused=f), 7),
        ("SGD", lambda f: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=f), 5),
    ]
    for name, make, words in rows:
        for fused in (None, True):
            opt = make(fused)
            ms = median_ms(opt.step, 3, args.iters)
            gbs = words * 4 * numel / (ms * 1e6)
            label = "fused" if fused else "foreach (default)"
            print(f"torch.optim.{name} ({label}): {ms:.4f} ms, {gbs:.1f} GB/s = {100 * gbs / copy_gbs:.0f}% of copy bandwidth")


if __name__ == "__main__":
    main()
