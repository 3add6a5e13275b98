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
request, any other Inductor option with --inductor-config KEY=VALUE (as
torch.compile's options=; repeatable). perf::CompiledModel reads what this tool
records in the package's metadata (`perf.input.N`) to check every call's inputs.
The package is run once on the example inputs and refused if an output differs
from the eager model's by more than rounding (check_compiled_outputs;
--no-verify keeps it anyway), with the cause where diagnose_compiled finds it.

Training (--train): the forward pass, the loss and the backward pass of one
step compiled together, for perf::CompiledTrainStep:

    python tools/export_compiled.py model.py:make --train --loss model.py:loss \
        --input 8,16 --input 8:int64 -o net_train.pt2

LOSS is a callable `loss(model, *batch) -> scalar tensor`; each --input is one
batch tensor, in the order step() takes them. The package takes the
parameters and buffers as inputs (C++ owns and updates them) and returns the
mutated buffers (BatchNorm statistics), the loss and one gradient per
trainable parameter; --amp and --channels-last put the recipe inside the
compiled graph. Under --amp, --attention fastest (the default) runs each
scaled_dot_product_attention in float32 where that measured faster for its
shape on the CPU (LibTorch's bf16 attention backward is slow there), as
perf::Autocast does in eager C++; --attention float32|autocast fixes it.
Parameter and buffer names, shapes, dtypes and strides are recorded in the
metadata so C++ matches them to its module by name. The
package is run once on the example batch and refused if its loss or a
gradient differs from the eager step's by more than rounding, measured
against the same step in float64 where the plain bounds are not enough
(--no-verify keeps it anyway); the
refusal names the cause where Inductor's Python wrapper finds it
(diagnose_compiled_step).

From Python, call export_compiled(module, example_inputs, path, ...) or
export_train(module, loss, example_batch, path, ...) directly.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "uint8": torch.uint8, "bool": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}


# Inductor options the exporter sets from its own arguments: passing them through inductor_configs
# would contradict an argument, so each is refused with the argument that sets it.
_OWN_CONFIGS = {
    "max_autotune": "use --max-autotune (max_autotune=True)",
    "freezing": "use --no-freezing (freezing=False); training packages never freeze",
    "fallback_random": "use --inductor-random (fallback_random=False)",
    "aot_inductor.metadata": "it holds the metadata perf reads",
}


def inductor_options(configs, what: str = "inductor_configs") -> dict:
    """Checks Inductor options for export_compiled/export_train's inductor_configs (what torch.compile takes
    as options= and aoti_compile_and_package as inductor_configs=): each key must name an option of
    torch._inductor.config (dotted for nested ones, e.g. "triton.cudagraphs") and each value fit the type
    the option is declared with. Returns a copy; raises ValueError naming `what` and the key otherwise."""
    import difflib
    import torch._inductor.config as inductor_config

    if configs is None:
        return {}
    if not isinstance(configs, dict):
        raise ValueError(f"{what} must be a dict of Inductor option -> value, got {type(configs).__name__}")
    known = inductor_config.get_config_copy()
    declared = getattr(inductor_config, "_config", {})
    out = {}
    for key, value in configs.items():
        if key in _OWN_CONFIGS:
            raise ValueError(f"{what} {key!r} is set by the exporter: {_OWN_CONFIGS[key]}")
        if key not in known:
            near = difflib.get_close_matches(str(key), list(known), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ValueError(f"{what} {key!r} is not an option of torch._inductor.config{hint}")
        # The declared type (torch 2.11's config entries carry it), else the default's; None: anything.
        default = known[key]
        kind = getattr(declared.get(key), "value_type", None if default is None else type(default))
        if not _fits(value, kind):
            name = str(kind).replace("typing.", "") if not isinstance(kind, type) else kind.__name__
            raise ValueError(f"{what} {key!r} takes {name} (default {default!r}), got {value!r}")
        out[key] = value
    return out


def _fits(value, kind) -> bool:
    """Whether `value` is of the declared type `kind` (the typing forms Inductor's options use)."""
    import types
    import typing

    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is None or kind is typing.Any:
        return True
    if kind is type(None):
        return value is None
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        return any(_fits(value, a) for a in args)
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(kind, type):
        return isinstance(value, kind)
    if origin in (list, tuple, dict, set, frozenset):
        return isinstance(value, origin)
    return True  # a Callable or another form: Inductor checks it


def cli_inductor_options(texts, flag: str = "--inductor-config") -> dict:
    """The options of command-line KEY=VALUE arguments (`flag`), checked by inductor_options: VALUE as a Python
    literal (True, 4, 'x', None), else as a string."""
    import ast

    options = {}
    for text in texts:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {text!r}: expected KEY=VALUE, e.g. coordinate_descent_tuning=True")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key.strip()] = value.strip()
    return inductor_options(options, flag)


def _compile_configs(options: dict, max_autotune: bool, metadata: dict, **own) -> dict:
    """What aoti_compile_and_package gets: --max-autotune as torch.compile(mode="max-autotune") compiles, less
    its CUDA graphs (perf::graph captures the package), i.e. Inductor's "max-autotune-no-cudagraphs" options
    (max_autotune, coordinate_descent_tuning); the user's options over those; the exporter's own last."""
    mode = torch._inductor.list_mode_options("max-autotune-no-cudagraphs") if max_autotune else {}
    return {**mode, **options, **own, "max_autotune": max_autotune, "aot_inductor.metadata": metadata}


_SHARED_LIBSTDCXX = ":libstdc++.so.6"  # -l:libstdc++.so.6, the runtime every process with torch has loaded


def shared_cxx_runtime(configs: dict | None = None) -> dict:
    """Inductor options that link a package's shared library against the shared libstdc++.so.6 by name (Linux,
    where the compiler finds it; {} elsewhere), on top of any aot_inductor.custom_op_libs in `configs`.

    Inductor leaves the C++ runtime to the compiler's default. A g++ that finds no libstdc++.so development
    link beside it links libstdc++.a into the package instead (seen on a GPU machine where Inductor's compiler is
    /opt/gcc/bin/g++, a GCC of its own beside the system's), and a
    package carrying its own copy of the runtime crashes when loaded into a process that has the shared one,
    which every Python with torch has: SIGSEGV in std::regex (AOTInductorModel's parse_device_str), in
    aoti_load_package and so in this tool's check of every training package. Naming the shared runtime on the
    link line, before the compiler's own -lstdc++, makes it the one the package uses; where the compiler links
    it anyway, nothing changes."""
    libs = list((configs or {}).get("aot_inductor.custom_op_libs") or [])
    if _SHARED_LIBSTDCXX in libs or not _compiler_finds(_SHARED_LIBSTDCXX[1:]):
        return {}
    return {"aot_inductor.custom_op_libs": libs + [_SHARED_LIBSTDCXX]}


def _compiler_finds(library: str) -> bool:
    """Whether Inductor's C++ compiler (CXX, else g++) resolves `library` on its link path (-print-file-name
    prints the bare name when it does not)."""
    import subprocess

    if not sys.platform.startswith("linux"):
        return False
    try:
        from torch._inductor import cpp_builder

        found = subprocess.run([cpp_builder.get_cpp_compiler(), f"-print-file-name={library}"], capture_output=True,
                               text=True, timeout=60, check=False).stdout.strip()
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return False
    return os.path.isabs(found) and os.path.exists(found)


def compile_and_package(program, path: str, configs: dict) -> str:
    """aoti_compile_and_package with the shared C++ runtime linked (shared_cxx_runtime), and the product checked
    for it (check_cxx_runtime): the package is written and usable, or refused and removed. The fake-tensor
    results torch.export cached are dropped first (forget_export_fake_results), and Inductor's check of the CPU's
    vector instruction sets answers from its last success (remember_vec_isa_checks)."""
    remember_vec_isa_checks()
    forget_export_fake_results(program)
    path = torch._inductor.aoti_compile_and_package(program, package_path=path,
                                                    inductor_configs={**configs, **shared_cxx_runtime(configs)})
    check_cxx_runtime(path)
    return path


_ISA_LOAD_OK = ".perf-load-ok"  # beside Inductor's probe source: this build of it loaded once


def remember_vec_isa_checks() -> None:
    """Makes Inductor's check of each vector instruction set (AVX2, AVX-512, AMX: cpu_vec_isa.VecISA.check_build)
    answer from a marker file where the same check passed before, instead of starting a Python that imports torch
    to load the probe's library: about a second per instruction set the CPU has (3-4 on a server CPU;
    pytorch/pytorch#100378, #140970), in every new process that compiles a package or loads one in Python, for
    any device (a package records the CPU's instruction set, codecache.get_device_information).

    Inductor keys the probe's source (and so the marker beside it, in its cache folder) by the compiler's version,
    the instruction set's flags and torch's version. Only a success is remembered, as pytorch/pytorch#190561
    proposes for Inductor itself: a failed check runs again in the next process. Where torch's
    internals differ from 2.11's, this does nothing and Inductor checks as it always does. Idempotent."""
    import contextlib

    try:
        from torch._inductor import codecache, cpu_vec_isa

        check_build = cpu_vec_isa.VecISA.check_build
        fingerprint = cpu_vec_isa._get_isa_dry_compile_fingerprint
        write = codecache.write
    except (ImportError, AttributeError):
        return
    if getattr(check_build, "_perf_remembers", False):
        return

    def remembered_check_build(isa, code: str) -> bool:
        try:
            _, source = write(code, "cpp", extra=fingerprint(isa._arch_flags))  # the key and file Inductor uses
        except (AttributeError, TypeError, OSError):
            return check_build(isa, code)
        marker = os.path.splitext(source)[0] + _ISA_LOAD_OK
        if os.path.isfile(marker):
            return True
        ok = check_build(isa, code)
        if ok:
            tmp = f"{marker}.{os.getpid()}"
            try:
                with open(tmp, "w") as f:
                    f.write(f"{isa} {isa._arch_flags}\n")
                os.replace(tmp, marker)  # whole or absent to a process checking at the same time
            except OSError:  # an unwritable cache: the next process checks again
                with contextlib.suppress(OSError):
                    os.remove(tmp)
        return ok

    remembered_check_build._perf_remembers = True
    cpu_vec_isa.VecISA.check_build = remembered_check_build


def forget_export_fake_results(program) -> None:
    """Empties FakeTensorMode's dispatch caches before Inductor compiles `program`.

    torch.export traces with cuDNN (and mkldnn, nnpack) turned off (torch/export/_trace.py,
    _ignore_backend_decomps), and the fake convolution takes its output's memory format from the backend
    ATen would pick (fake_impls.conv: _select_conv_backend): without cuDNN, contiguous. FakeTensorMode caches
    each op's fake result by the op and its arguments' metadata, not by those flags, and AOTInductor (like
    torch.compile's C++ wrapper) compiles in the export's fake mode (compile_fx._extract_inputs_from_exported_gm):
    its plan for a CUDA convolution on channels-last tensors came from that cache, contiguous, while cuDNN
    returns channels-last, and the package read it in the wrong order (the channels-last CNN's wrong first
    weight gradient; docs/compiled-training.md). Inductor's Python wrapper traces in a fake mode of its
    own, whose shape environment's settings key the cache apart, and was right. Emptied, the caches make the
    compile ask again, with cuDNN on."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.cache_clear()
    for node in program.graph.nodes:
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        cache = getattr(getattr(mode, "shape_env", None), "fake_tensor_cache", None)
        if cache is not None:
            cache.clear()


def check_cxx_runtime(path: str) -> None:
    """Raises RuntimeError (and removes the package) where a package's Linux shared library does not load the
    shared C++ runtime, i.e. carries a copy of its own (see shared_cxx_runtime)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        libs = [n for n in z.namelist() if n.endswith(".so")]
        needed = {n: _elf_needed(z.read(n)) for n in libs}
    for name, deps in needed.items():
        if deps is None or any(d.startswith(("libstdc++.so", "libc++.so")) for d in deps):
            continue
        os.remove(path)
        from torch._inductor import cpp_builder

        cxx = cpp_builder.get_cpp_compiler()
        why = ("found no shared libstdc++.so to link" if not _compiler_finds(_SHARED_LIBSTDCXX[1:]) else
               "linked the static libstdc++ although the shared one was named (-l:libstdc++.so.6)")
        raise RuntimeError(
            f"{os.path.basename(name)} in {path} carries its own copy of the C++ runtime (it needs only "
            f"{', '.join(deps) or 'nothing'}): the compiler {cxx} {why}, and a package with a private libstdc++ "
            "crashes when loaded next to torch's (SIGSEGV in std::regex). Install the libstdc++ development files "
            "of that compiler (Debian/Ubuntu: libstdc++-<version>-dev) or point CXX at a compiler that links the "
            "shared libstdc++; the package was removed")


def _elf_needed(data: bytes):
    """The DT_NEEDED entries of a 64-bit little-endian ELF file; None for any other file."""
    import struct

    if data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01":
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _, kind, _, _, offset, size, link, *_ in sections:
        if kind != 6:  # SHT_DYNAMIC; its sh_link is the string table its entries name
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                start = strings + value
                needed.append(data[start:data.index(b"\0", start)].decode())
    return needed


def _options_entry(options: dict) -> str:
    return " ".join(f"{k}={v!r}" for k, v in sorted(options.items()))


def _format_of(t: torch.Tensor) -> str:
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    return "contiguous"


def _input_entry(t: torch.Tensor, dynamic_batch) -> str:
    sizes = ["-1" if (dynamic_batch is not None and d == 0) else str(s) for d, s in enumerate(t.shape)]
    entry = f"dtype={NAMES.get(t.dtype, str(t.dtype))} device={t.device.type} sizes={','.join(sizes)} format={_format_of(t)}"
    if dynamic_batch is not None:
        entry += f" min={dynamic_batch[0]} max={dynamic_batch[1]}"
    return entry


def _dynamic_inputs(inputs, dynamic_batch):
    """Inputs to trace with (a batch of 1 would be specialised by export: 2 instead) and their dynamic_shapes."""
    if dynamic_batch is None:
        return list(inputs), tuple(None for _ in inputs)
    lo, hi = dynamic_batch
    if not (1 <= lo <= hi):
        raise ValueError(f"dynamic_batch must be (min, max) with 1 <= min <= max, got {dynamic_batch}")
    batch = torch.export.Dim("batch", min=lo, max=hi)
    traced = []
    for t in inputs:
        if t.dim() == 0:
            raise ValueError("dynamic_batch needs every input to have a batch dimension (a 0-d input was given)")
        if t.shape[0] < 2 <= hi:
            t = torch.cat([t] * 2)[:2]
        traced.append(t)
    return traced, tuple({0: batch} for _ in traced)


def export_compiled(model: torch.nn.Module, example_inputs, path: str, *,
                    dynamic_batch: tuple[int, int] | None = (1, 1024),
                    device: str = "cpu", dtype: torch.dtype = torch.float32,
                    channels_last: bool = False, freezing: bool = True,
                    max_autotune: bool = False, model_name: str = "model", inductor_configs=None,
                    verify: bool = True) -> str:
    """Compile `model` for `example_inputs` (a tuple of tensors) into the package `path`.

    dynamic_batch: (min, max) of dimension 0 of every input, or None for static shapes.
    Floating inputs and parameters are cast to `dtype`; 4-d float inputs become
    channels-last when `channels_last` (the model too). inductor_configs: more Inductor
    options ({"coordinate_descent_tuning": True}), checked by inductor_options and recorded
    in the metadata (perf.inductor_configs). verify: run the package once on the example
    inputs and refuse it (ValueError, the package removed) if an output differs from the
    eager model's by more than rounding (check_compiled_outputs), with the cause where
    diagnose_compiled finds it."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise ValueError(f"dtype must be a floating type (float32, float16, bfloat16, float64), got {dtype}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' needs a CUDA GPU in this Python (torch.cuda.is_available() is False)")
    options = inductor_options(inductor_configs)
    _check_module(model)
    _check_takes(model.forward, tuple(example_inputs), f"the model's {type(model).__name__}.forward",
                 _count(len(example_inputs), "input"))
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
    inputs, dynamic_shapes = _dynamic_inputs(inputs, dynamic_batch)
    if dynamic_batch is None:
        dynamic_shapes = None
    with torch.no_grad():
        outputs = model(*inputs)
        n_out = len(torch.utils._pytree.tree_leaves(outputs))
        program = torch.export.export(model, tuple(inputs), dynamic_shapes=dynamic_shapes)
        metadata = {"perf.inputs": str(len(inputs)), "perf.outputs": str(n_out),
                    "perf.torch": torch.__version__, "perf.tool": "export_compiled.py 2",
                    "perf.kind": "inference", "perf.max_autotune": "1" if max_autotune else "0",
                    "perf.inductor_configs": _options_entry(options)}
        for i, t in enumerate(inputs):
            metadata[f"perf.input.{i}"] = _input_entry(t, dynamic_batch)
        configs = _compile_configs(options, max_autotune, metadata, freezing=freezing)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        path = compile_and_package(program, path, configs)
    if verify:
        _verify_inference(path, program, model, inputs, outputs, dtype, configs)
    return path


def _verify_inference(path: str, program, model, inputs, outputs, dtype, configs) -> None:
    """The package at `path` run once on `inputs` against the eager `outputs`; refused and removed if wrong."""
    flat = torch.utils._pytree.tree_leaves
    want = flat(outputs)
    with torch.no_grad():
        got = flat(torch._inductor.aoti_load_package(path)(*inputs))
    try:
        check_compiled_outputs(got, want, dtype)
    except ValueError:
        # Past the plain bound: rounding (a deep model in bf16) or a wrong program; float64 tells them apart.
        reference = precise_outputs(model, inputs)
        try:
            check_compiled_outputs(got, want, dtype, reference)
        except ValueError as err:
            os.remove(path)
            cause = diagnose_compiled(program, inputs,
                                      lambda out: _passes(check_compiled_outputs, out, want, dtype, reference),
                                      configs=configs, inference=True)
            raise ValueError(f"{err} {cause}") from None


def precise_outputs(model, inputs):
    """The outputs (a flat list) of `model` on `inputs` in float64, on a copy of the model: the reference
    check_compiled_outputs measures rounding against. None where the model cannot run in float64."""
    import copy

    try:
        twin = copy.deepcopy(model).to(torch.float64)
        with torch.no_grad(), torch.autocast(inputs[0].device.type, enabled=False):
            out = twin(*[t.to(torch.float64) if t.is_floating_point() else t for t in inputs])
        return torch.utils._pytree.tree_leaves(out)
    except Exception:  # noqa: BLE001  (the check then keeps its plain bound)
        return None


def check_compiled_outputs(got, want, dtype: torch.dtype = torch.float32, reference=None) -> None:
    """Raises ValueError naming the first output of a compiled model (a flat list of tensors) that differs from
    the eager model's on the same inputs by more than rounding: a wrong program. The rule of check_compiled_step:
    relative to each output's largest |value|, 1e-2 for a float32 or float64 model and 0.1 for bfloat16 or
    float16; past that, against `reference` (precise_outputs: the model in float64), the compiled output may be
    no farther than three times eager's distance, or 2e-2 / 5e-2. Outputs that are not floating point (an
    argmax) are checked for shape only: a tie broken the other way is rounding, not a wrong program."""
    if len(got) != len(want):
        raise ValueError(f"the compiled model returned {len(got)} outputs, the eager model {len(want)}")
    low = dtype in (torch.bfloat16, torch.float16)
    rtol, floor = (0.1, 5e-2) if low else (1e-2, 2e-2)
    refs = reference if reference is not None and len(reference) == len(want) else [None] * len(want)
    wrong = []
    for i, (g, w, r) in enumerate(zip(got, want, refs)):
        if not (isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)):
            continue
        if not w.is_floating_point():
            why = None if g.shape == w.shape else f"shape {tuple(g.shape)} where eager's is {tuple(w.shape)}"
        else:
            why = _differs(g, w, r, rtol, floor, "the model")
        if why is not None:
            wrong.append((i, why))
    if wrong:
        (i, why), others = wrong[0], [str(j) for j, _ in wrong[1:]]
        also = f" Also past their bounds: output{'s' if len(others) > 1 else ''} {', '.join(others)}." if others else ""
        raise ValueError(
            f"the compiled model is wrong: output {i} differs from the eager model's on the example inputs: {why}."
            f"{also} The compiler produced a wrong program; the package was not kept. --no-verify (verify=False) "
            "keeps such a package anyway.")


class _LossStep(torch.nn.Module):
    """One training step's differentiable part: forward(scale, *batch) -> (loss * scale, loss).

    The scale is an input so that a GradScaler's scale (and 1/k for gradient
    accumulation) multiplies the loss inside the graph: the gradients come out
    scaled as loss.backward() on a scaled loss would give them."""

    def __init__(self, model, loss, device_type, amp_dtype):
        super().__init__()
        self.model = model
        self.loss = loss
        self.device_type = device_type
        self.amp_dtype = amp_dtype

    def forward(self, scale, *batch):
        with torch.autocast(self.device_type, dtype=self.amp_dtype or torch.bfloat16, enabled=self.amp_dtype is not None):
            loss = self.loss(self.model, *batch)
        loss = loss.float()
        return loss * scale, loss.detach()


class _FlatStep(torch.nn.Module):
    """The joint graph with every parameter and buffer as a plain input: [state..., scale, batch...] ->
    [mutated buffers..., loss, gradients...], each gradient laid out like its parameter."""

    def __init__(self, joint_gm, placeholders, outputs, grad_layouts):
        super().__init__()
        self.joint = joint_gm
        self.placeholders = placeholders  # per joint input: ("arg", i) or ("const", name)
        self.outputs = outputs  # indexes of the joint outputs kept
        self.grad_layouts = grad_layouts  # output position -> memory format to make the gradient match its parameter
        self.consts = {}

    def forward(self, *args):
        full = [args[i] if kind == "arg" else self.consts[i] for kind, i in self.placeholders]
        outs = self.joint(*full)
        kept = []
        for pos, j in enumerate(self.outputs):
            t = outs[j]
            fmt = self.grad_layouts.get(pos)
            kept.append(t.contiguous(memory_format=fmt) if fmt is not None else t)
        return tuple(kept)


def _probe(fn, *args):
    """fn(*args): export_train's eager runs on the example batch before compiling (the loss's type, the
    gradients' layouts). bench/e2e/kernel_plans.py runs them on fake tensors, as it only plans the graph."""
    return fn(*args)


def _layout_fix(grad: torch.Tensor, param: torch.Tensor):
    """The memory format that gives `grad` its parameter's strides, or None when they already match."""
    if all(n <= 1 or g == p for n, g, p in zip(param.shape, grad.stride(), param.stride())):
        return None  # the same layout (strides of one-element dimensions do not matter)
    if param.dim() == 4 and param.is_contiguous(memory_format=torch.channels_last) and not param.is_contiguous():
        return torch.channels_last
    if param.is_contiguous():
        return torch.contiguous_format
    raise ValueError(f"parameter of shape {tuple(param.shape)} has strides {param.stride()}: "
                     "only contiguous and channels-last parameters can be trained from a package")


AMP = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}
ATTENTION = ("fastest", "float32", "autocast")


class AttentionPrecision:
    """Where autocast would run scaled_dot_product_attention in the lower dtype, run it in float32 instead:
    in every such call (mode "float32") or where float32 measured faster for the call's shape ("fastest",
    the CPU only), as perf::Autocast::set_cpu_attention does in C++ for training. Meant for training
    steps: it does not look at grad mode (a step being traced carries none). Calls with dropout_p > 0 keep
    LibTorch's policy (inputs cast to the autocast dtype, float64 left alone). The float32 result is cast
    back to the autocast dtype, so nothing downstream changes dtype.

    Why: LibTorch 2.11's bf16 flash-attention backward on the CPU has a large cost per (batch, head)
    block: at 64 tokens and head size 32, forward and backward take 5.1 ms in bf16 and 0.9 ms in fp32
    (bench_amp on a 2-core Xeon with AMX). On CUDA the lower dtype's kernels are the fast ones, so
    "fastest" measures nothing there and keeps autocast's policy.

    A context manager: it registers its kernel for the Autocast key of `device` on entry and removes it
    on exit. measure=True (eager calls on real tensors) times forward and backward of both variants on
    scratch inputs of the call's sizes and strides (a private generator: the caller's random state is
    untouched), 1 warm-up and 3 runs each (alternating), keeps the faster; where the autocast dtype's
    first timed run takes over 0.25 s, float32 is not timed (the autocast dtype is kept). With
    measure=False a call whose shape was not measured keeps autocast's policy. `choices` maps each
    measured shape to (float32 picked, its line)."""

    def __init__(self, device: str, mode: str):
        if mode not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {mode!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.device, self.mode = device, mode
        self.choices = {}
        self.measure = False
        self.key = torch._C.DispatchKey.AutocastCPU if device == "cpu" else torch._C.DispatchKey.AutocastCUDA
        self._lib = None

    def __enter__(self):
        if self.mode == "float32" or (self.mode == "fastest" and self.device == "cpu"):
            with warnings.catch_warnings():  # the dispatcher's "Overriding a previously registered kernel"
                warnings.simplefilter("ignore", UserWarning)
                self._lib = torch.library.Library("aten", "IMPL")
                self._lib.impl("scaled_dot_product_attention", self._kernel, self.key.name)
        return self

    def __exit__(self, *exc):
        if self._lib is not None:
            self._lib._destroy()  # LibTorch's own autocast kernel is back
            self._lib = None
        return False

    def lines(self):
        return [line for _, line in self.choices.values()]

    def _sdpa(self, compute, lower, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
        """The op in `compute` (autocast's eligible inputs cast: floating, not float64), returned in `lower`
        where it was computed in float32."""
        def cast(t):
            eligible = t is not None and t.is_floating_point() and t.dtype != torch.float64
            return t.to(compute) if eligible and t.dtype != compute else t
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(self.key)):
            out = torch.ops.aten.scaled_dot_product_attention(cast(q), cast(k), cast(v), cast(mask), dropout_p,
                                                              is_causal, scale=scale, enable_gqa=enable_gqa)
        return out.to(lower) if compute == torch.float32 and out.dtype == torch.float32 else out

    def _kernel(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        lower = torch.get_autocast_dtype(self.device)
        use_float = False
        if dropout_p == 0.0:
            if self.mode == "float32":
                use_float = True
            elif self.device == "cpu":
                key = _attention_key(lower, q, k, v, attn_mask, is_causal, enable_gqa)
                if key not in self.choices and self.measure:
                    self.choices[key] = self._measure(lower, q, k, v, attn_mask, is_causal, scale, enable_gqa)
                use_float = key in self.choices and self.choices[key][0]
        return self._sdpa(torch.float32 if use_float else lower, lower, q, k, v, attn_mask, dropout_p, is_causal,
                          scale, enable_gqa)

    def _measure(self, lower, q, k, v, mask, is_causal, scale, enable_gqa):
        shapes = " ".join(_describe(t) for t in (q, k, v)) + (f" mask {_describe(mask)}" if mask is not None else "")
        shapes += " causal" if is_causal else ""
        try:
            g = torch.Generator(device=q.device).manual_seed(0x5eed)

            def scratch(t):
                s = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                if t.is_floating_point():
                    s.normal_(generator=g)
                return s.requires_grad_(t.requires_grad)

            sq, sk, sv = scratch(q), scratch(k), scratch(v)
            sm = scratch(mask) if mask is not None else None
            leaves = [t for t in (sq, sk, sv, sm) if t is not None and t.requires_grad]
            go = []

            def run(compute):
                started = time.perf_counter()
                with torch.enable_grad():
                    out = self._sdpa(compute, lower, sq, sk, sv, sm, 0.0, is_causal, scale, enable_gqa)
                    if not go:
                        go.append(torch.empty_like(out).normal_(generator=g))
                    if leaves:
                        torch.autograd.grad([out], leaves, [go[0]], allow_unused=True)
                return (time.perf_counter() - started) * 1e3

            run(lower)  # warm-up: the first call in a process also pays one-time setup
            low = run(lower)
            if low > 250.0:
                why = f"autocast dtype kept unmeasured (one forward and backward took {low:.0f} ms)"
                return False, f"{shapes} -> {NAMES[lower]} ({why})"
            run(torch.float32)
            flt = run(torch.float32)
            for _ in range(2):
                flt = min(flt, run(torch.float32))
                low = min(low, run(lower))
        except Exception as e:  # e.g. out of memory for the scratch copies: the step keeps autocast's policy
            return False, f"{shapes} -> {NAMES[lower]} (autocast dtype kept, the measurement failed: {e})"
        pick = flt < low
        return pick, (f"{shapes} -> {'float32' if pick else NAMES[lower]} "
                      f"(float32 {flt:.3f} ms, {NAMES[lower]} {low:.3f} ms)")


def _hint(n) -> int:
    """A size as the example has it: the example's value of a symbolic (dynamic batch) size."""
    if isinstance(n, torch.SymInt):
        try:  # torch 2.11; renamed guarding_hint_or_throw in 2.12
            from torch.fx.experimental.symbolic_shapes import size_hint
        except ImportError:
            from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw as size_hint
        try:
            return size_hint(n)
        except Exception:  # no example value (data-dependent): matches no measured shape
            return -1
    return int(n)


def _attention_key(lower, q, k, v, mask, is_causal, enable_gqa):
    key = [str(lower), bool(is_causal), bool(enable_gqa)]
    for t in (q, k, v, mask):
        key.append(None if t is None else (str(t.dtype), tuple(_hint(n) for n in t.shape),
                                           tuple(_hint(n) for n in t.stride())))
    return tuple(key)


def _describe(t) -> str:
    return f"{NAMES.get(t.dtype, str(t.dtype))}[{','.join(str(_hint(n)) for n in t.shape)}]"


def _attention_ops(gm) -> list[str]:
    """The dtype each attention forward in the graph `gm` computes in, in graph order (from the graph itself)."""
    ops = []
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op == "call_function" and "scaled_dot_product" in name and "backward" not in name:
            val = node.args[0].meta.get("val") if node.args and hasattr(node.args[0], "meta") else None
            ops.append(NAMES.get(val.dtype, str(val.dtype)) if val is not None else "unknown")
    return ops


def _joint_program(program):
    """Forward and backward of `program` (loss at output 0) as one ExportedProgram, like
    torch.export.experimental._export_forward_backward, keeping the CPU flash-attention op whole.

    torch 2.11's core decompositions rewrite _scaled_dot_product_flash_attention_for_cpu into math ops whose
    second output is the attention matrix, while the joint graph's backward stays the flash backward, which
    reads that output as the logsumexp: wrong gradients for every model with attention on the CPU
    (torch/_decomp/decompositions.py, scaled_dot_product_flash_attention_for_cpu). Inductor does not use that
    decomposition either; without it the forward keeps its real logsumexp."""
    from torch._decomp import core_aten_decompositions
    from torch.export.experimental import _copy_graph_module_and_signature, _remove_detach_pass
    from torch.export.exported_program import _decompose_exported_program

    table = core_aten_decompositions()
    table.pop(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    joint = _decompose_exported_program(program, cia_to_decomp={}, python_decomp_table=table, joint_loss_index=0,
                                        decompose_custom_triton_ops=False)
    gm, signature = _copy_graph_module_and_signature(joint)
    _remove_detach_pass(gm, signature)
    return joint._update(gm, signature)


def _check_module(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _check_takes(fn, args, what: str, given: str) -> None:
    """ValueError where fn(*args) would not bind: `what` (the loss, the model's forward) takes other arguments
    than the example tensors give; `given` says what the caller gave, for the message."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the call will tell
        return
    try:
        signature.bind(*args)
    except TypeError as e:
        raise ValueError(f"{what}{signature} cannot take {given}: {e}; give one example tensor (--input) per "
                         "tensor it takes") from None


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def export_train(model: torch.nn.Module, loss, example_batch, path: str, *,
                 dynamic_batch: tuple[int, int] | None = None, device: str = "cpu", amp: str = "off",
                 channels_last: bool = False, max_autotune: bool = False, fallback_random: bool = True,
                 attention: str = "fastest", model_name: str = "model", verify: bool = True,
                 inductor_configs=None) -> str:
    """Compile one training step of `model` — loss(model, *batch), its backward — into the package `path`.

    The package takes (parameters and buffers in the module's order, a 0-d float32 scale, the batch) and
    returns (the buffers the step mutates, the float32 loss, one gradient of loss * scale per trainable
    parameter). amp: "off", "bf16" or "fp16" autocast around the loss function, inside the graph;
    channels_last: the model and 4-d float batch tensors in channels-last. dynamic_batch: (min, max) of
    dim 0 of every batch tensor, or None (static shapes: best for CUDA graphs). fallback_random: random
    ops (dropout) draw from ATen's generator as eager does, instead of inductor's own. attention: under amp,
    scaled_dot_product_attention in float32 where it measured faster on the example batch ("fastest",
    CPU only; eager runs the model's forward once for it, its buffers restored), always ("float32") or in
    the autocast dtype ("autocast"): see AttentionPrecision; the pick is printed and recorded in the
    metadata with the dtype each attention op of the compiled graph computes in. inductor_configs: more
    Inductor options, as export_compiled takes them (the check and its diagnosis compile with them too).
    verify: run the package once on the example batch and refuse it (ValueError) if its loss or a gradient
    differs from the eager step's (check_compiled_step); skipped with fallback_random=False, whose draws
    differ from eager's."""
    from torch.export.graph_signature import InputKind, OutputKind

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' needs a CUDA GPU in this Python (torch.cuda.is_available() is False)")
    if amp not in AMP:
        raise ValueError(f"amp must be one of {', '.join(AMP)}, got {amp!r}")
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    if not callable(loss):
        raise ValueError("loss must be a callable loss(model, *batch) -> scalar tensor")
    options = inductor_options(inductor_configs)
    _check_module(model)
    _check_takes(loss, (model, *example_batch), f"the loss {getattr(loss, '__name__', type(loss).__name__)}",
                 f"(model, {_count(len(example_batch), 'batch tensor')})")
    model = model.to(device).train()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    batch = []
    for t in example_batch:
        t = t.to(device)
        if channels_last and t.dim() == 4 and t.is_floating_point():
            t = t.contiguous(memory_format=torch.channels_last)
        batch.append(t)
    batch, batch_dynamic = _dynamic_inputs(batch, dynamic_batch)
    scale = torch.ones((), device=device)
    step = _LossStep(model, loss, device, AMP[amp])
    with torch.no_grad():
        probe = _probe(step.loss, model, *batch)
    if not (isinstance(probe, torch.Tensor) and probe.numel() == 1 and probe.is_floating_point()):
        got = (f"a {str(probe.dtype).replace('torch.', '')} tensor of shape {list(probe.shape)}"
               if isinstance(probe, torch.Tensor) else f"{type(probe).__name__} {probe!r:.100}")
        raise ValueError(f"loss must return a floating-point scalar tensor (one element), got {got}")
    precision = AttentionPrecision(device, attention if amp != "off" else "autocast")
    if precision.mode == "fastest" and device == "cpu":
        # One eager forward, with grad, measures each attention shape; the model's buffers (BatchNorm
        # statistics) and the random state are as they were.
        saved = {n: b.clone() for n, b in model.named_buffers()}
        with torch.random.fork_rng(devices=[]), precision, torch.enable_grad():
            precision.measure = True
            step(scale, *batch)
            precision.measure = False
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(saved[n])
        for line in precision.lines():
            print(f"attention: {line}", flush=True)
    dyn = (None, tuple(batch_dynamic)) if dynamic_batch is not None else None
    with precision:
        program = torch.export.export(step, (scale, *batch), dynamic_shapes=dyn)
        joint = _joint_program(program)
    sig = joint.graph_signature

    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    names, placeholders = [], []
    user = 0
    for spec in sig.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            if not spec.target.startswith("model."):
                raise ValueError(f"unexpected state {spec.target!r} outside the model")
            names.append(spec.target[len("model."):])
            placeholders.append(("arg", len(names) - 1))
        elif spec.kind == InputKind.USER_INPUT:
            placeholders.append(("user", user))
            user += 1
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            placeholders.append(("const", spec.target))
        else:
            raise ValueError(f"the training graph has an input of kind {spec.kind.name}, which perf cannot feed")
    n_state = len(names)
    placeholders = [("arg", n_state + i) if kind == "user" else (kind, i) for kind, i in placeholders]
    index = {n: i for i, n in enumerate(names)}
    mutated, grads, outputs, loss_at = [], [], [], None
    for j, spec in enumerate(sig.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutated.append(index[spec.target[len("model."):]])
            outputs.append(j)
        elif spec.kind == OutputKind.USER_OUTPUT:
            loss_at = j
        elif spec.kind == OutputKind.GRADIENT_TO_PARAMETER:
            grads.append(index[spec.target[len("model."):]])
        elif spec.kind == OutputKind.LOSS_OUTPUT:
            pass
        else:
            raise ValueError(f"the training step mutates or returns {spec.kind.name} ({spec.target}); perf's "
                             "compiled training handles buffer mutations, the loss and parameter gradients")
    outputs.append(loss_at)
    grad_outputs = [j for j, spec in enumerate(sig.output_specs) if spec.kind == OutputKind.GRADIENT_TO_PARAMETER]
    with torch.no_grad():
        flat_state = [state[n].detach() for n in names]
        torch.manual_seed(0)  # the same dropout draws as the package's run in verify
        probe_outs = _probe(joint.graph_module, *[
            (flat_state + [scale] + batch)[i] if kind == "arg" else joint.constants[i] for kind, i in placeholders])
    grad_layouts = {}
    for k, j in enumerate(grad_outputs):
        fmt = _layout_fix(probe_outs[j], flat_state[grads[k]])
        if fmt is not None:
            grad_layouts[len(outputs) + k] = fmt
    outputs += grad_outputs
    flat = _FlatStep(joint.graph_module, placeholders, outputs, grad_layouts)
    for kind, name in placeholders:
        if kind == "const":
            flat.consts[name] = joint.constants[name]
    flat_dyn = None
    if dynamic_batch is not None:
        flat_dyn = (tuple([None] * (n_state + 1)) + tuple(batch_dynamic),)
    flat_program = torch.export.export(flat, tuple(flat_state + [scale] + batch), dynamic_shapes=flat_dyn)

    def csv(v):
        return ",".join(str(x) for x in v)

    metadata = {"perf.kind": "train", "perf.inputs": str(len(batch)), "perf.torch": torch.__version__,
                "perf.tool": "export_compiled.py 2", "perf.train.state": str(n_state),
                "perf.train.mutated": csv(mutated), "perf.train.grads": csv(grads), "perf.train.amp": amp,
                "perf.train.channels_last": "1" if channels_last else "0",
                "perf.train.attention": precision.mode if amp != "off" else "off",
                "perf.train.attention.ops": ",".join(_attention_ops(joint.graph_module)),
                "perf.train.attention.choices": " | ".join(precision.lines()),
                "perf.max_autotune": "1" if max_autotune else "0", "perf.inductor_configs": _options_entry(options)}
    params = dict(model.named_parameters(remove_duplicate=False))
    for i, n in enumerate(names):
        t = state[n]
        metadata[f"perf.train.state.{i}"] = (
            f"name={n} kind={'param' if n in params else 'buffer'} grad={1 if i in grads else 0} "
            f"dtype={NAMES.get(t.dtype, str(t.dtype))} sizes={csv(t.shape)} strides={csv(t.stride())}")
    for i, t in enumerate(batch):
        metadata[f"perf.input.{i}"] = _input_entry(t, dynamic_batch)
    configs = _compile_configs(options, max_autotune, metadata, fallback_random=fallback_random)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    path = compile_and_package(flat_program, path, configs)
    if verify and fallback_random:
        runner = torch._inductor.aoti_load_package(path)
        with torch.no_grad():
            torch.manual_seed(0)
            got = runner(*flat_state, scale, *batch)
        m = len(mutated)
        want = (probe_outs[loss_at], [probe_outs[j] for j in grad_outputs], [names[i] for i in grads], amp)
        try:
            check_compiled_step(got[m], list(got[m + 1:]), *want)
        except ValueError:
            # Past the plain bound: rounding (bf16 on a deep CNN at initialisation differs from itself by more) or a
            # wrong program. The same step at higher precision tells them apart.
            reference = precise_step(model, loss, batch, [names[i] for i in grads])
            try:
                check_compiled_step(got[m], list(got[m + 1:]), *want, reference=reference)
            except ValueError as err:
                os.remove(path)
                cause = diagnose_compiled_step(flat_program, flat_state + [scale] + batch, m, *want, configs=configs,
                                               reference=reference)
                raise ValueError(f"{err} {cause}") from None
    return path


def precise_step(model, loss, batch, names):
    """The loss and the gradients of the parameters `names` of one eager step at a higher precision than any
    package's: float64, without autocast, on a copy of `model` (its BatchNorm statistics are left alone). The
    reference check_compiled_step measures rounding against. None where the model cannot run in float64 (a
    forward that makes float32 tensors of its own, say)."""
    import copy

    try:
        twin = copy.deepcopy(model).to(torch.float64)
        params = dict(twin.named_parameters(remove_duplicate=False))
        wanted = [params[n] for n in names]
        with torch.enable_grad(), torch.autocast(batch[0].device.type, enabled=False):
            torch.manual_seed(0)  # the draws of the eager step's and the package's runs
            value = loss(twin, *[t.to(torch.float64) if t.is_floating_point() else t for t in batch])
            grads = torch.autograd.grad(value, wanted, allow_unused=True)
        return value.detach(), [torch.zeros_like(w) if g is None else g for w, g in zip(wanted, grads)]
    except Exception:  # noqa: BLE001  (the check then keeps its plain bound)
        return None


def _differs(got, want, ref, rtol: float, floor: float, what: str):
    """Why `got` (a compiled program's tensor) is farther from `want` (eager's) than rounding, or None: the rule
    check_compiled_step documents, with the plain bound `rtol` of the largest |value| and, against `ref` (the
    same computation in float64, or None), the floor `floor`. `what` names the computation in the message."""

    def distance(a, r):  # relative L2; nan for a nan
        n = r.norm().item()
        return (a - r).norm().item() / n if n > 0 else (a - r).norm().item()

    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} where eager's is {tuple(want.shape)}"
    scale = want.abs().max().item() if want.numel() else 0.0
    d = (got - want).abs().max().item() if want.numel() else 0.0
    if d <= rtol * scale + 1e-6:  # false for nan
        return None
    why = f"max |difference| {d:.3g}, max |value| {scale:.3g} (allowed {rtol:g} of it)"
    if ref is None:
        return why
    ref = ref.detach().double().cpu()
    compiled, eager = distance(got, ref), distance(want, ref)
    allowed = max(floor, 3 * eager)
    if compiled <= allowed:
        return None
    return (f"{why}; against {what} in float64, the compiled one is {compiled:.3g} away and the eager one "
            f"{eager:.3g} (relative L2; allowed {allowed:.3g})")


def check_compiled_step(loss, grads, want_loss, want_grads, names, amp: str = "off", reference=None) -> None:
    """Raises ValueError naming the first gradient (or the loss) of a compiled training step that differs from
    the eager step's on the same inputs by more than rounding: a wrong program, which would train silently
    worse. Plain bounds, relative to the largest |value| of each tensor: 1e-2 in fp32, 0.1 under autocast (bf16
    keeps 8 bits: 1.4e-3 seen on a small CNN; a gradient with its elements misplaced differs by about its own
    size).

    reference: (loss, gradients) of the same step at a higher precision (precise_step), for a model whose
    rounding alone goes past the plain bounds. A deep CNN under bf16 at initialisation does (bench/e2e's, on the
    CPU: eager bf16 is 0.2-0.7 away from float64 in L2 norm, relative, in most of its gradients; Inductor's fp32
    sums 2.7e-3 where ATen's CPU BatchNorm sums in double). With one, a tensor past its plain bound passes when
    the compiled step is no farther from the reference than three times the eager step's distance, or than 2e-2
    (fp32) / 5e-2 (autocast), in L2 norm relative to the reference's. Rounding keeps about as close as eager
    (at most 2.2x its distance over 16 sizes, seeds and layouts of that CNN, in a tensor of 8 elements); a
    misplaced gradient is about 1.4 away, which a tensor whose eager distance is under 0.45 shows."""
    rtol = 1e-2 if amp == "off" else 0.1
    floor = 2e-2 if amp == "off" else 5e-2
    if len(grads) != len(want_grads):
        raise ValueError(f"the compiled step returned {len(grads)} gradients, the eager step {len(want_grads)}")
    ref_loss, ref_grads = reference if reference is not None else (None, [None] * len(grads))
    checks = [("the loss", loss, want_loss, ref_loss)] + [
        (f"the gradient of {n}", g, w, r) for n, g, w, r in zip(names, grads, want_grads, ref_grads)]
    # Every tensor is checked, so that the error says how far the fault reaches (one convolution's gradient, or
    # everything downstream of the loss): where to look in the generated code.
    wrong = [(what, why) for what, got, want, ref in checks
             for why in [_differs(got, want, ref, rtol, floor, "the step")] if why is not None]
    if wrong:
        (what, why), others = wrong[0], [w[len("the gradient of "):] for w, _ in wrong[1:]]
        also = (f" Also past their bounds: the gradient{'s' if len(others) > 1 else ''} of {', '.join(others)} "
                f"({len(wrong)} of {len(checks)} tensors wrong; the loss and every gradient were checked).") if others \
            else {1: "", 2: " The other tensor is within its bound."}.get(
                len(checks), f" The other {len(checks) - 1} tensors are within their bounds.")
        raise ValueError(
            f"the compiled training step is wrong: {what} differs from the eager step's on the example batch: "
            f"{why}.{also} The compiler produced a wrong program; the package was not kept. "
            "--no-verify (verify=False) keeps such a package anyway.")


def diagnose_compiled_step(program, inputs, mutated: int, want_loss, want_grads, names, amp: str = "off", *,
                           configs=None, reference=None) -> str:
    """Why a training package failed check_compiled_step, in a sentence for its error (diagnose_compiled, with
    the step's outputs as `right` reads them: the mutated buffers, then the loss and the gradients)."""

    return diagnose_compiled(program, inputs, lambda out: _passes(check_compiled_step, out[mutated], out[mutated + 1:],
                                                                  want_loss, want_grads, names, amp, reference),
                             configs=configs)


def _passes(check, *args) -> bool:
    """Whether check(*args) (check_compiled_step or check_compiled_outputs) finds the result right."""
    try:
        check(*args)
        return True
    except ValueError:
        return False


def diagnose_compiled(program, inputs, right, *, configs=None, inference: bool = False) -> str:
    """Why a package of `program` computed a wrong result on `inputs`, in a sentence for its error: the same graph
    compiled once more by Inductor's Python wrapper (torch.compile's), and run on the same inputs; where that is
    right (`right(outputs)`, the outputs as a flat list), once more by torch.compile's C++ wrapper
    (cpp_wrapper=True), which generates the code AOTInductor builds, without AOTInductor's packaging, loader and
    runtime. inference: compile under no_grad, as the inference export does (freezing applies only there).

    The Python wrapper checks after every fallback kernel (an ATen or custom op that Inductor calls instead of
    generating code for it) that the output has the sizes and strides the compiler planned from the op's fake
    (meta) kernel. AOTInductor's C++ wrapper does not (torch 2.11: ir.ExternKernel.codegen_size_asserts is skipped
    for cpp_wrapper), so where a fake kernel predicts other strides than the real kernel returns, the package's
    generated code reads that output in the wrong order: wrong numbers, no error."""
    import contextlib

    options = {k: v for k, v in (configs or {}).items() if not k.startswith("aot_inductor.")}
    options["size_asserts"] = True  # the point of this compilation, whatever the package was built with
    options["fx_graph_cache"] = False  # a cached graph is not lowered again, and its plan is what this reads

    def run(plans=None, **patch):
        forget_export_fake_results(program)
        with torch._inductor.config.patch(**options, **patch), _recorded_plans(plans if plans is not None else []), \
                (torch.no_grad() if inference else contextlib.nullcontext()):
            compiled = torch._inductor.compile(program.module(), list(inputs))
        with torch.no_grad():
            torch.manual_seed(0)  # the draws of the package's run
            return torch.utils._pytree.tree_leaves(compiled(*inputs))

    python_plans = []
    try:
        out = run(python_plans)
    except Exception as e:  # noqa: BLE001  (the refusal stands; the diagnosis is a courtesy)
        text = str(e).strip()
        if not (isinstance(e, AssertionError) and text.startswith("expected size")):
            first = (text.splitlines() or [""])[0][:300]
            return f"(Looking for the cause with Inductor's Python wrapper failed: {type(e).__name__}: {first})"
        # assert_size_stride's message: "expected size ..., stride ... at dim=1; ...", then "Error in op: ..."
        said = "; ".join(line.strip() for line in text.splitlines()[:2] if line.strip())
        return ("Cause, from the same graph compiled by Inductor's Python wrapper, which checks each fallback kernel's "
                f"output strides (AOTInductor's C++ wrapper does not): {said} (actual==planned). That kernel's fake "
                "(meta) kernel predicts other strides than its real one returns; give its inputs one memory format, "
                "or export without --channels-last.")
    if not right(out):
        return ("The same graph compiled by Inductor's Python wrapper (which checks every fallback kernel's strides) "
                "is wrong too, and no kernel's strides differ from the plan: the fault is in Inductor's generated code "
                "for this graph.")
    said = "The same graph compiled by Inductor's Python wrapper is right"
    cpp_plans = []
    try:
        cpp = right(run(cpp_plans, cpp_wrapper=True))
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return (f"{said}: the fault is in AOTInductor's C++ build of it (compiling it with torch.compile's C++ "
                f"wrapper, to tell which part, failed: {type(e).__name__}: {first}).")
    if cpp:
        return (f"{said}, and so is it under torch.compile's C++ wrapper (cpp_wrapper=True), which generates the code "
                "AOTInductor builds: the fault is in what AOTInductor adds (its packaging, loader or runtime).")
    return (f"{said}; under torch.compile's C++ wrapper (cpp_wrapper=True) it is wrong: the fault is in the C++ "
            "wrapper code Inductor generates for this graph, which AOTInductor builds, not in AOTInductor's packaging "
            f"or runtime. {_compare_plans(python_plans, cpp_plans)}")


class _recorded_plans:
    """Context manager: appends to `plans`, for each graph Inductor lowers inside it, the layouts it planned
    (_plan_of), once per graph, when code generation starts."""

    def __init__(self, plans: list):
        self.plans = plans

    def __enter__(self):
        from torch._inductor.graph import GraphLowering

        self.saved = GraphLowering.codegen, GraphLowering.codegen_with_cpp_wrapper
        seen, plans = set(), self.plans

        def recording(method):
            def wrapped(graph, *args, **kwargs):
                if id(graph) not in seen:
                    seen.add(id(graph))
                    try:
                        plans.append(_plan_of(graph))
                    except Exception as e:  # noqa: BLE001  (a diagnosis must not break the compile)
                        plans.append({"error": f"{type(e).__name__}: {e}"})
                return method(graph, *args, **kwargs)
            return wrapped

        GraphLowering.codegen = recording(self.saved[0])
        GraphLowering.codegen_with_cpp_wrapper = recording(self.saved[1])
        return self

    def __exit__(self, *exc):
        from torch._inductor.graph import GraphLowering

        GraphLowering.codegen, GraphLowering.codegen_with_cpp_wrapper = self.saved
        return False


def _plan_of(graph) -> dict:
    """What Inductor decided for one graph before generating code: whether it lays convolutions out
    channels-last (layout_opt), the strides it compiles each input for, and the strides it planned for each
    kernel it calls rather than generates (a fallback or extern kernel: convolutions, matmuls), keyed by the
    graph nodes it computes."""
    from torch._inductor import ir

    def strides(layout):
        return tuple(int(s) if getattr(s, "is_number", True) else str(s) for s in layout.stride)

    inputs = {name: strides(box.get_layout()) for name, box in graph.graph_inputs.items()
              if isinstance(box, ir.IRNode) and hasattr(box.get_layout(), "stride")}
    extern = {}
    for buf in graph.buffers:
        layout = getattr(buf, "layout", None)
        if isinstance(buf, ir.ExternKernel) and isinstance(layout, ir.Layout) and hasattr(layout, "stride"):
            nodes = sorted(o.name for o in getattr(buf, "origins", ()) if o.op == "call_function")
            if nodes:
                extern[" ".join(nodes)] = strides(layout)
    return {"layout_opt": bool(graph.layout_opt), "inputs": inputs, "extern": extern}


def _compare_plans(python_plans: list, cpp_plans: list, most: int = 4) -> str:
    """A sentence on how Inductor planned the same graph under its Python and its C++ wrapper (_plan_of)."""
    if not python_plans or not cpp_plans or len(python_plans) != len(cpp_plans):
        return (f"(Inductor's plans were not comparable: {len(python_plans)} graph(s) lowered under the Python "
                f"wrapper, {len(cpp_plans)} under the C++ one.)")
    found = []
    for py, cpp in zip(python_plans, cpp_plans):
        if "error" in py or "error" in cpp:
            return f"(Reading Inductor's plans failed: {py.get('error') or cpp.get('error')}.)"
        if py["layout_opt"] != cpp["layout_opt"]:
            on = lambda v: "on" if v else "off"  # noqa: E731
            found.append(f"channels-last layout optimization {on(cpp['layout_opt'])} (the Python wrapper's: "
                         f"{on(py['layout_opt'])})")
        for name, st in cpp["inputs"].items():
            if name in py["inputs"] and py["inputs"][name] != st:
                found.append(f"input {name} compiled for strides {st} (the Python wrapper's: {py['inputs'][name]})")
        for nodes, st in cpp["extern"].items():
            if nodes in py["extern"] and py["extern"][nodes] != st:
                found.append(f"the output of {nodes} planned with strides {st} (the Python wrapper's: "
                             f"{py['extern'][nodes]})")
        only = sorted(set(cpp["extern"]) ^ set(py["extern"]))
        if only and not found:
            found.append(f"{len(only)} kernel call(s) that only one of them makes (e.g. {only[0]})")
    if not found:
        return ("Inductor planned the same layouts under both wrappers (layout optimization, inputs' strides and "
                "every fallback kernel's output strides): the difference is in the code generated from that plan.")
    more = f"; and {len(found) - most} more" if len(found) > most else ""
    return ("Inductor planned this graph differently under the C++ wrapper: " + "; ".join(found[:most]) + more +
            ". The Python wrapper's plan is the one that computes the right result.")


def load_factory(spec: str, what: str = "FACTORY"):
    if ":" not in spec:
        raise SystemExit(f"{what} must be file.py:function or module:function, got {spec!r}")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        if not os.path.exists(where):
            raise SystemExit(f"{what}: no file {where!r}")
        module_spec = importlib.util.spec_from_file_location("perf_export_factory", where)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise SystemExit(f"{what}: {where!r} has no {name!r}")
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
    # torch 2.11's export copies its pytree specs through a path it deprecated itself: not the user's to fix.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("factory", help="file.py:function or module:function returning the nn.Module")
    p.add_argument("-o", "--output", required=True, help="package to write (.pt2)")
    p.add_argument("--input", action="append", required=True, metavar="SHAPE[:DTYPE]",
                   help="one positional input, e.g. 8,3,224,224 or 8,128:int64 (repeat for several)")
    p.add_argument("--kwargs", default="{}", help="JSON keyword arguments for the factory")
    p.add_argument("--dynamic-batch", default=None, metavar="MIN:MAX",
                   help="range of dimension 0 of every input, or 'static' for fixed shapes (default: 1:1024 for "
                        "inference, static for --train: CUDA graphs capture one shape)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--channels-last", action="store_true", help="model and 4-d inputs in channels-last")
    p.add_argument("--no-freezing", action="store_true", help="keep weights as swappable constants")
    p.add_argument("--max-autotune", action="store_true",
                   help="autotune GEMMs/convolutions and Triton kernels' launch configurations, as "
                        "torch.compile(mode='max-autotune') does without its CUDA graphs (slow to compile)")
    p.add_argument("--no-verify", action="store_true",
                   help="keep the package without running it once against the eager model (or step) on the example "
                        "inputs")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before the factory runs")
    p.add_argument("--inductor-config", action="append", default=[], metavar="KEY=VALUE",
                   help="one more Inductor option (torch._inductor.config), as torch.compile's options=, e.g. "
                        "coordinate_descent_tuning=True or triton.cudagraphs=False; repeat for several")
    train = p.add_argument_group("training (perf::CompiledTrainStep)")
    train.add_argument("--train", action="store_true",
                       help="compile one training step (forward, loss, backward) instead of inference")
    train.add_argument("--loss", metavar="LOSS", help="file.py:function or module:function, loss(model, *batch) -> "
                       "scalar tensor; each --input is one batch tensor, in the order step() takes them")
    train.add_argument("--amp", default="off", choices=list(AMP), help="autocast inside the compiled step")
    train.add_argument("--attention", default="fastest", choices=list(ATTENTION),
                       help="under --amp, scaled_dot_product_attention in float32 where faster for its shape "
                            "(fastest: measured on the example batch, CPU only), always (float32), or in the "
                            "autocast dtype (autocast)")
    train.add_argument("--inductor-random", action="store_true",
                       help="random ops (dropout) from inductor's own generator: faster, but other draws than eager")
    a = p.parse_args(argv)
    if a.train and not a.loss:
        p.error("--train needs --loss file.py:function (loss(model, *batch) -> scalar)")
    if a.loss and not a.train:
        p.error("--loss goes with --train")
    if a.train and a.dtype != "float32":
        p.error("--train keeps the model's own dtype: use --amp bf16|fp16 for mixed precision, not --dtype")
    if a.dynamic_batch is None:
        a.dynamic_batch = "static" if a.train else "1:1024"
    if a.dynamic_batch == "static":
        dynamic = None
    else:
        try:
            lo, hi = (int(v) for v in a.dynamic_batch.split(":"))
        except ValueError:
            raise SystemExit(f"--dynamic-batch must be MIN:MAX (e.g. 1:1024) or 'static', got {a.dynamic_batch!r}")
        dynamic = (lo, hi)
    try:
        options = cli_inductor_options(a.inductor_config)
    except ValueError as e:
        raise SystemExit(f"export_compiled.py: {e}")
    if a.device == "cuda" and not torch.cuda.is_available():  # before the model is built, and without a traceback
        raise SystemExit("export_compiled.py: --device cuda needs a CUDA GPU in this Python (torch.cuda.is_available() "
                         "is False): export where the package will run, or --device cpu")
    dtype = DTYPES[a.dtype]
    torch.manual_seed(a.seed)
    try:
        kwargs, why = json.loads(a.kwargs), ""
    except json.JSONDecodeError as e:
        kwargs, why = None, f" ({e})"
    if not isinstance(kwargs, dict):
        raise SystemExit(f"--kwargs must be a JSON object of the factory's keyword arguments, e.g. "
                         f"'{{\"width\": 64}}', got {a.kwargs!r}{why}")
    model = load_factory(a.factory)(**kwargs)
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"FACTORY: {a.factory} returned {type(model).__name__}, not a torch.nn.Module")
    inputs = tuple(parse_input(s, dtype) for s in a.input)
    if a.train:
        started = time.time()
        try:
            out = export_train(model, load_factory(a.loss, "--loss"), inputs, a.output, dynamic_batch=dynamic,
                               device=a.device, amp=a.amp, channels_last=a.channels_last, max_autotune=a.max_autotune,
                               fallback_random=not a.inductor_random, attention=a.attention,
                               verify=not a.no_verify, inductor_configs=options)
        except ValueError as e:
            raise SystemExit(f"export_compiled.py: {e}")
        print(f"wrote {out} (training step, {time.time() - started:.0f} s)")
        return 0
    try:
        out = export_compiled(model, inputs, a.output, dynamic_batch=dynamic, device=a.device, dtype=dtype,
                              channels_last=a.channels_last, freezing=not a.no_freezing,
                              max_autotune=a.max_autotune, inductor_configs=options, verify=not a.no_verify)
    except ValueError as e:
        raise SystemExit(f"export_compiled.py: {e}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    import faulthandler

    faulthandler.enable()  # a crash in Inductor's compiler or AOTInductor's loader then names the Python line
    sys.exit(main())
