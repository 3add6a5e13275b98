#!/usr/bin/env python3
"""Export a PyTorch model to an AOTInductor package (.pt2) for perf::CompiledModel.

    python tools/export_compiled.py my_models.py:make_resnet -o resnet.pt2 \
        --input 8,3,224,224 --dynamic-batch 1:256 --device cuda --dtype bfloat16

FACTORY is `path/to/file.py:function` or `package.module:function`; it returns
the nn.Module (keyword arguments with --kwargs '{"width": 64}'). Each --input is
one positional input: its shape, and optionally its dtype (`8,128:int64`;
floating inputs take --dtype). The package is compiled the way inductor
recommends for inference: eval mode, no autograd, weights frozen into the
graph (--no-freezing keeps them as constants you can swap), max-autotune on
request. perf::CompiledModel reads what this tool records in the package's
metadata (`perf.input.N`) to check every call's inputs.

From Python, call export_compiled(module, example_inputs, path, ...) directly.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys

import torch

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "uint8": torch.uint8, "bool": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}


def _format_of(t: torch.Tensor) -> str:
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    return "contiguous"


def export_compiled(model: torch.nn.Module, example_inputs, path: str, *,
                    dynamic_batch: tuple[int, int] | None = (1, 1024),
                    device: str = "cpu", dtype: torch.dtype = torch.float32,
                    channels_last: bool = False, freezing: bool = True,
                    max_autotune: bool = False, model_name: str = "model") -> str:
    """Compile `model` for `example_inputs` (a tuple of tensors) into the package `path`.

    dynamic_batch: (min, max) of dimension 0 of every input, or None for static shapes.
    Floating inputs and parameters are cast to `dtype`; 4-d float inputs become
    channels-last when `channels_last` (the model too)."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise ValueError(f"dtype must be a floating type (float32, float16, bfloat16, float64), got {dtype}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' needs a CUDA GPU in this Python (torch.cuda.is_available() is False)")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(device=device, dtype=dtype).eval()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    inputs = []
    for t in example_inputs:
        t = t.to(device)
        if t.is_floating_point():
            t = t.to(dtype)
        if t.dim() == 4 and t.is_floating_point():
            t = t.contiguous(memory_format=fmt)
        inputs.append(t)
    dynamic_shapes = None
    if dynamic_batch is not None:
        lo, hi = dynamic_batch
        if not (1 <= lo <= hi):
            raise ValueError(f"dynamic_batch must be (min, max) with 1 <= min <= max, got {dynamic_batch}")
        batch = torch.export.Dim("batch", min=lo, max=hi)
        # An example batch of 1 would be specialised by export: trace with 2.
        traced = []
        for t in inputs:
            if t.dim() == 0:
                raise ValueError("dynamic_batch needs every input to have a batch dimension (a 0-d input was given)")
            if t.shape[0] < 2 <= hi:
                t = torch.cat([t] * 2)[:2]
            traced.append(t)
        inputs = traced
        dynamic_shapes = tuple({0: batch} for _ in inputs)
    with torch.no_grad():
        outputs = model(*inputs)
        n_out = len(torch.utils._pytree.tree_leaves(outputs))
        program = torch.export.export(model, tuple(inputs), dynamic_shapes=dynamic_shapes)
        metadata = {"perf.inputs": str(len(inputs)), "perf.outputs": str(n_out),
                    "perf.torch": torch.__version__, "perf.tool": "export_compiled.py 1"}
        for i, t in enumerate(inputs):
            sizes = ["-1" if (dynamic_batch is not None and d == 0) else str(s) for d, s in enumerate(t.shape)]
            entry = f"dtype={NAMES.get(t.dtype, str(t.dtype))} device={t.device.type} sizes={','.join(sizes)} format={_format_of(t)}"
            if dynamic_batch is not None:
                entry += f" min={dynamic_batch[0]} max={dynamic_batch[1]}"
            metadata[f"perf.input.{i}"] = entry
        configs = {"freezing": freezing, "max_autotune": max_autotune, "aot_inductor.metadata": metadata}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=configs)


def load_factory(spec: str):
    if ":" not in spec:
        raise SystemExit(f"FACTORY must be file.py:function or module:function, got {spec!r}")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        if not os.path.exists(where):
            raise SystemExit(f"FACTORY: no file {where!r}")
        module_spec = importlib.util.spec_from_file_location("perf_export_factory", where)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise SystemExit(f"FACTORY: {where!r} has no {name!r}")
    return getattr(module, name)


def parse_input(text: str, dtype: torch.dtype) -> torch.Tensor:
    shape, _, kind = text.partition(":")
    try:
        sizes = [int(s) for s in shape.split(",") if s]
    except ValueError:
        raise SystemExit(f"--input {text!r}: sizes must be integers separated by commas, e.g. 8,3,224,224")
    if kind and kind not in DTYPES:
        raise SystemExit(f"--input {text!r}: dtype must be one of {', '.join(DTYPES)}")
    t_dtype = DTYPES[kind] if kind else dtype
    if t_dtype.is_floating_point:
        return torch.randn(sizes, dtype=t_dtype)
    if t_dtype == torch.bool:
        return torch.zeros(sizes, dtype=torch.bool)
    return torch.zeros(sizes, dtype=t_dtype)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("factory", help="file.py:function or module:function returning the nn.Module")
    p.add_argument("-o", "--output", required=True, help="package to write (.pt2)")
    p.add_argument("--input", action="append", required=True, metavar="SHAPE[:DTYPE]",
                   help="one positional input, e.g. 8,3,224,224 or 8,128:int64 (repeat for several)")
    p.add_argument("--kwargs", default="{}", help="JSON keyword arguments for the factory")
    p.add_argument("--dynamic-batch", default="1:1024", metavar="MIN:MAX",
                   help="range of dimension 0 of every input (default 1:1024); 'static' for fixed shapes")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--channels-last", action="store_true", help="model and 4-d inputs in channels-last")
    p.add_argument("--no-freezing", action="store_true", help="keep weights as swappable constants")
    p.add_argument("--max-autotune", action="store_true", help="autotune GEMMs/convolutions (slow to compile)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before the factory runs")
    a = p.parse_args(argv)
    if a.dynamic_batch == "static":
        dynamic = None
    else:
        try:
            lo, hi = (int(v) for v in a.dynamic_batch.split(":"))
        except ValueError:
            raise SystemExit(f"--dynamic-batch must be MIN:MAX (e.g. 1:1024) or 'static', got {a.dynamic_batch!r}")
        dynamic = (lo, hi)
    dtype = DTYPES[a.dtype]
    torch.manual_seed(a.seed)
    model = load_factory(a.factory)(**json.loads(a.kwargs))
    inputs = tuple(parse_input(s, dtype) for s in a.input)
    out = export_compiled(model, inputs, a.output, dynamic_batch=dynamic, device=a.device, dtype=dtype,
                          channels_last=a.channels_last, freezing=not a.no_freezing,
                          max_autotune=a.max_autotune)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
