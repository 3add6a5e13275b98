"""Inductor's plan for a CUDA device, on a machine without one: what the exporter's tests need to show that
AOTInductor lays out CUDA convolutions as cuDNN does (tools/export_compiled.py, forget_export_fake_results)
where no GPU can run the package.

Fake CUDA tensors (FakeTensorMode) need no device. torch.export traces them when its fake mode is theirs (a
TracingContext), and Inductor lowers the exported graph for CUDA once it can read the device's properties: an
H100's, given here, with the backend an H100 gives bf16 convolutions. Code generation is where a device would
be needed (Triton), so lowering stops there, after export_compiled._recorded_plans has read the plan. Where a
GPU is present, its own properties are used."""
import contextlib
import types

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

_H100 = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3 (simulated)", major=9, minor=0, multi_processor_count=132,
    regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32,
    total_memory=80 * 2**30, L2_cache_size=50 * 2**20, gcnArchName="", uuid="simulated")


class StopAtCodegen(Exception):
    """Raised where Inductor would start generating code: the plan is made, and nothing runs on a device."""


def simulate() -> None:
    """Without a GPU: CUDA's device queries answer as an H100's, and CUDA counts as initialised (only fake
    tensors are made on it). With one: nothing changes."""
    if torch.cuda.is_available():
        return
    from torch._dynamo import device_interface

    torch.cuda.get_device_properties = lambda *a, **k: _H100
    torch.cuda.get_device_capability = lambda *a, **k: (_H100.major, _H100.minor)
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda._initialized = True  # Tensor.to(device="cuda") of a fake tensor would otherwise start the driver
    # Inductor's constant folding of a joint graph computes with real tensors, which need a device.
    torch._inductor.config.joint_graph_constant_folding = False
    cuda = device_interface.CudaInterface
    cuda.get_compute_capability = staticmethod(lambda device=None: _H100.major * 10 + _H100.minor)
    cuda.get_device_properties = staticmethod(lambda device=None: _H100)
    cuda.Worker.get_device_properties = staticmethod(lambda device=None: _H100)
    torch._C._select_conv_backend = _bf16_as_on_an_h100(torch._C._select_conv_backend)


def _bf16_as_on_an_h100(select):
    """ATen's choice of convolution backend (what the fake convolution takes its layout from), with bf16 answered
    as on an H100. ATen's use_cudnn takes a bf16 convolution only where the device says cuDNN v8 can
    (CUDAHooks::supportsBFloat16ConvolutionWithCuDNNv8: compute capability 8 or more), and without a device that
    is no. Its other criteria do not depend on bf16 (fp16's depthwise rule is fp16's only), so on an H100 a
    bf16 convolution gets the backend its fp32 twin gets."""

    def as_fp32(t):
        bf16_cuda = isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.dtype == torch.bfloat16
        return t.float() if bf16_cuda else t

    def select_conv_backend(*args, **kwargs):
        return select(*map(as_fp32, args), **{k: as_fp32(v) for k, v in kwargs.items()})

    return select_conv_backend


def export_on_fake_cuda(make_model, *shapes, channels_last: bool = False):
    """torch.export of make_model() in eval mode, its parameters and random inputs of `shapes` fake CUDA tensors
    (4-d ones channels-last when `channels_last`), traced as the exporter traces real ones (cuDNN off). The
    parameters do not require grad, as a training package's state (plain inputs) or a frozen model's: those
    that do key FakeTensorMode's cache apart from what the compiler later asks."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def build():
        with torch.device("cuda"):
            model = make_model().eval().requires_grad_(False)
            for module in model.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None and p.dim() == 4:
                        module._parameters[name] = torch.nn.Parameter(p.detach().contiguous(memory_format=fmt),
                                                                      requires_grad=False)
            return model, tuple(torch.randn(s).contiguous(memory_format=fmt) if len(s) == 4 else torch.randn(s)
                                for s in shapes)

    return _export_fake(build)


def _export_fake(build):
    """torch.export of the (module, inputs) that build() makes in a fake mode of its own, traced in that mode
    (a TracingContext: torch.export would otherwise fakify them again in a mode of its own, and refuse the mix)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(tracked_fakes=[]))
    with mode:
        module, inputs = build()
    with torch._guards.tracing(torch._guards.TracingContext(mode)), torch.no_grad():
        return torch.export.export(module, inputs)


def exported_graph(exporter, export):
    """(program, configs) that `export()` (a call of exporter.export_compiled or export_train) hands to
    exporter.compile_and_package: the graph it would compile, and the Inductor options; nothing is compiled."""

    class Got(Exception):
        pass

    got, compile_and_package = {}, exporter.compile_and_package

    def grab(program, path, configs):
        got.update(program=program, configs=configs)
        raise Got()

    exporter.compile_and_package = grab
    try:
        export()
    except Got:
        pass
    finally:
        exporter.compile_and_package = compile_and_package
    return got["program"], got["configs"]


def on_fake_cuda(program):
    """`program` (exported on the CPU: a training step's graph, whose backward is spelled out in it, can be
    traced on fake CUDA tensors without the autograd engine, which needs a device) exported again on fake CUDA
    tensors of the same sizes, strides and dtypes, the graph's own CPU tensors moved to CUDA."""
    module = on_cuda_devices(program.module())
    return _export_fake(lambda: (module, tuple(fake_cuda_like(n.meta["val"]) for n in program.graph.nodes
                                               if n.op == "placeholder")))


def on_cuda_devices(module):
    """`module` (an fx.GraphModule) with the CPU devices its nodes name (factory functions' device=) turned into
    cuda:0."""
    for node in module.graph.nodes:
        device = node.kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cpu":
            node.kwargs = {**node.kwargs, "device": torch.device("cuda", 0)}
    module.recompile()
    return module


def fake_cuda_like(t):
    """A CUDA tensor with t's sizes, strides and dtype, made in the fake mode active around the call."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")


def python_wrapper_plans(exporter, program, configs) -> list:
    """Inductor's plans for `program` under its Python wrapper (torch.compile's, which traces in a fake mode of
    its own), with the Inductor options of `configs` (AOTInductor's own left out)."""
    options = {k: v for k, v in configs.items() if not k.startswith("aot_inductor.")}
    with FakeTensorMode():
        inputs = [fake_cuda_like(n.meta["val"]) for n in program.graph.nodes if n.op == "placeholder"]
    plans = []
    with planned_only(exporter, plans), torch._inductor.config.patch({**options, "fx_graph_cache": False}), \
            torch.no_grad():
        torch._inductor.compile(program.module(), inputs)
    return plans


class planned_only:
    """Context manager: Inductor lowers graphs up to code generation and stops there (StopAtCodegen, which it
    swallows on the way out); `plans` gets each graph's plan (export_compiled._plan_of), or summary(graph)
    where a summary is given (bench/e2e/kernel_plans.py's, from Inductor's scheduler)."""

    def __init__(self, exporter, plans: list, summary=None):
        from torch._inductor.graph import GraphLowering

        self.graph, self.plans, self.summary = GraphLowering, plans, summary
        self.recorded = exporter._recorded_plans(plans) if summary is None else contextlib.nullcontext()

    def __enter__(self):
        def stop(graph, *args, **kwargs):
            if self.summary is not None:
                self.plans.append(self.summary(graph))
            raise StopAtCodegen()

        self.saved = self.graph.codegen, self.graph.codegen_with_cpp_wrapper
        self.graph.codegen = self.graph.codegen_with_cpp_wrapper = stop
        self.recorded.__enter__()  # records, then calls stop
        return self

    def __exit__(self, kind, error, tb):
        self.recorded.__exit__(kind, error, tb)
        self.graph.codegen, self.graph.codegen_with_cpp_wrapper = self.saved
        # Inductor wraps what a lowering raises (InductorError), with the original as its cause.
        while error is not None and not isinstance(error, StopAtCodegen):
            error = error.__cause__ or error.__context__
        return error is not None
