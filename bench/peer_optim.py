"""Python peer of bench_optim.cpp: torch.optim AdamW / Adam / SGD(momentum), fused=True and the default
(foreach), on the same parameter sets (ResNet-50's 161 tensors; AdamW alone on a transformer's 148, 98 of them
vectors), an EMA of each set's weights (AveragedModel.update_parameters), and Muon over a transformer's weight
matrices, with the copy_
bandwidth of the same process, so that the C++ figures can be read against Python's best in the same run. Medians
per step (CUDA events on a GPU, the host clock on the CPU); with --json, one JSON line per configuration appended
(the rows bench/report_optim.py reads beside bench_optim's).

    python bench/peer_optim.py [--device cuda] [--iters 20] [--json out.jsonl]"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import median_ms_on  # noqa: E402


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


def transformer_shapes(d=256):
    """bench_optim.cpp's transformer_shapes(): a GPT-style decoder, 12 layers of width 256."""
    s = [(8192, d), (1024, d)]
    for _ in range(12):
        s += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return s + [(d,), (d,)]


# The transformer's set is there for AdamW, the one optimizer bench_optim's flat mode runs on it.
SETS = (("ResNet-50", resnet50_shapes, ("AdamW", "Adam", "SGD")), ("transformer", transformer_shapes, ("AdamW",)))
# Adam(W) reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq (7 x 4 bytes a
# parameter); SGD with momentum reads param, grad, buffer and writes param, buffer (5 x 4 bytes).
OPTIMIZERS = (("AdamW", lambda ps, f: torch.optim.AdamW(ps, lr=1e-3, fused=f), 7),
              ("Adam", lambda ps, f: torch.optim.Adam(ps, lr=1e-3, fused=f), 7),
              ("SGD", lambda ps, f: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=f), 5))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="file to append one JSON line per configuration to")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("peer_optim: --device cuda, but torch sees no CUDA device")
    torch.manual_seed(0)
    src = torch.empty(256 << 20, device=a.device)  # 1 GiB
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.nbytes / (median_ms_on(a.device, lambda: dst.copy_(src), 2, 10) * 1e6)
    del src, dst
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__} on {where}")
    print(f"copy bandwidth (1 GiB copy_, read+write): {copy_gbs:.1f} GB/s")
    rows = []
    with torch.no_grad():
        for set_name, shapes, names in SETS:
            params = []
            for shape in shapes():
                t = torch.randn(shape, device=a.device, requires_grad=True)
                t.grad = torch.randn(shape, device=a.device)
                params.append(t)
            numel = sum(t.numel() for t in params)
            print(f"\n{set_name} parameter set: {len(params)} tensors, {numel} parameters")
            for name, make, words in (o for o in OPTIMIZERS if o[0] in names):
                for fused in (None, True):
                    opt = make(params, fused)
                    ms = median_ms_on(a.device, opt.step, a.warmup, a.iters)
                    gbs = words * 4 * numel / (ms * 1e6)
                    config = f"torch.optim.{name} ({'fused' if fused else 'foreach, the default'})"
                    print(f"{config}: {ms:.4f} ms, {gbs:.1f} GB/s = {100 * gbs / copy_gbs:.0f}% of copy bandwidth")
                    rows.append({"lang": "python", "device": a.device, "set": set_name, "tensors": len(params),
                                 "params": numel, "optimizer": name, "config": config, "median_ms": ms,
                                 "bytes": words * 4 * numel, "copy_gbs": copy_gbs, "torch": torch.__version__})
                    del opt
            # An EMA of the weights after each step: Python's AveragedModel with get_ema_multi_avg_fn(0.999)
            # (reads averaged and current, writes averaged: 3 x 4 bytes a parameter).
            model = torch.nn.Module()
            model.params = torch.nn.ParameterList(params)
            ema = torch.optim.swa_utils.AveragedModel(
                model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.999))
            ema.update_parameters(model)  # the first update copies
            ms = median_ms_on(a.device, lambda: ema.update_parameters(model), a.warmup, a.iters)
            gbs = 3 * 4 * numel / (ms * 1e6)
            config = "torch AveragedModel EMA (update_parameters)"
            print(f"{config}: {ms:.4f} ms, {gbs:.1f} GB/s = {100 * gbs / copy_gbs:.0f}% of copy bandwidth")
            rows.append({"lang": "python", "device": a.device, "set": f"{set_name} EMA", "tensors": len(params),
                         "params": numel, "optimizer": "EMA", "config": config, "median_ms": ms,
                         "bytes": 3 * 4 * numel, "copy_gbs": copy_gbs, "torch": torch.__version__})
            del ema, model
        # Muon over the transformer's 48 weight matrices (bench_optim's transformer_matrices: width 256 on a GPU,
        # 64 on a CPU, where bfloat16 products are slow), Python's loop over them; compute, not traffic (bytes 0).
        width = 256 if a.device == "cuda" else 64
        matrices = []
        for _ in range(12):
            for shape in ((3 * width, width), (width, width), (4 * width, width), (width, 4 * width)):
                t = torch.randn(shape, device=a.device, requires_grad=True)
                t.grad = torch.randn(shape, device=a.device)
                matrices.append(t)
        numel = sum(t.numel() for t in matrices)
        muon = torch.optim.Muon(matrices, lr=0.02)
        warmup, iters = (a.warmup, a.iters) if a.device == "cuda" else (1, min(a.iters, 5))
        ms = median_ms_on(a.device, muon.step, warmup, iters)
        config = "torch.optim.Muon"
        print(f"\ntransformer Muon (width {width}): {len(matrices)} matrices, {numel} parameters\n{config}: {ms:.4f} ms")
        rows.append({"lang": "python", "device": a.device, "set": f"transformer Muon (width {width})",
                     "tensors": len(matrices), "params": numel, "optimizer": "Muon", "config": config,
                     "median_ms": ms, "bytes": 0, "copy_gbs": copy_gbs, "torch": torch.__version__})
    if a.json:
        with open(a.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
