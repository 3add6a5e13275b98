"""What Inductor plans for one bench/e2e training step on a CUDA device, without one: perf's package (the
joint forward+backward graph that tools/export_compiled.py --train hands AOTInductor) against Python's
torch.compile (AOTAutograd's partition into a forward and a backward graph, each lowered by Inductor).

Both are traced on the CPU, retargeted to CUDA and lowered for a simulated H100 (tests/compiled/simulated_cuda.py)
up to Inductor's scheduler, which fuses the graph into the kernels it would generate. Nothing runs on a device,
so this tells the two plans apart, not their speed: how many fused (Triton) kernels, which extern kernels
(cuDNN convolutions, matmuls), the bytes the fused kernels read and write and each graph's peak buffer memory
(Inductor's own estimates), whether
layout optimization (channels-last convolutions) is on, the layout each convolution backward gets (the one
the traced graph recorded, even where the forward convolutions were made channels-last), and the mix-order
reductions (a row-wise and a column-wise reduction of one input in one kernel, as in LayerNorm's backward), which
Inductor makes for large enough inputs under the Python wrapper only, never under AOTInductor's C++ wrapper.
Autocast follows the CPU's policy here (the trace is on the CPU), the same for both sides, and attention keeps the
CPU's kernels (extern, as on CUDA).

    python bench/e2e/kernel_plans.py --job cnn --batch 8 --amp bf16 --layout contiguous

The two sides can run in separate processes (at once, on two cores) and be compared afterwards:

    python bench/e2e/kernel_plans.py --side perf --save perf.json ...
    python bench/e2e/kernel_plans.py --side compile --save compile.json ...
    python bench/e2e/kernel_plans.py --load perf.json --load compile.json --check 0.15

Nothing runs for real either (the exporter's probes and torch.compile's first step run on fake tensors), so it
takes under a minute per side for the CNN on 2 cores, with or without native bf16 on the CPU."""
import argparse
import collections
import copy
import importlib.util
import json
import os
import sys
from unittest import mock

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(ROOT, "tools"), os.path.join(ROOT, "tests", "compiled")]
import export_compiled as exporter  # noqa: E402
import simulated_cuda as sim  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: E402


def e2e_models():
    spec = importlib.util.spec_from_file_location("e2e_models", os.path.join(HERE, "models.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["e2e_models"] = module  # dynamo imports the loss's module by name
    spec.loader.exec_module(module)
    return module


def simulate_codegen() -> None:
    """simulate(), and what Inductor asks before it schedules Triton kernels: Triton present, bf16 supported;
    matmul padding off (it decides by timing on the device)."""
    sim.simulate()
    from torch._dynamo import device_interface
    from torch._inductor import scheduler
    import torch.utils._triton

    scheduler.has_triton = torch.utils._triton.has_triton = lambda *a, **k: True
    device_interface.CudaInterface.is_bf16_supported = staticmethod(lambda *a, **k: True)
    torch._inductor.config.shape_padding = False


def memory_format(node) -> str:
    """The memory format of a 4-d IR node's fixed layout: "channels-last", "NCHW" or "other" (a dimension of
    size 1 matches either)."""
    layout = node.get_layout()
    size, stride = [int(v) for v in layout.size], [int(v) for v in layout.stride]
    if len(size) != 4:
        return "other"
    _, c, h, w = size
    wanted = {"channels-last": (h * w * c, 1, w * c, c), "NCHW": (c * h * w, h * w, w, 1)}
    for name, order in wanted.items():
        if all(a == b or n == 1 for a, b, n in zip(stride, order, size)):
            return name
    return "other"


def backward_conv_formats(graph) -> collections.Counter:
    """The memory format of each convolution backward's gradient and input (one string when they agree).
    Inductor gives that extern call the strides the traced graph recorded (constrain_to_fx_strides), whatever
    layout optimization chose for the forward convolutions."""
    formats = collections.Counter()
    for op in graph.operations:
        if "convolution_backward" in str(getattr(op, "python_kernel_name", "") or ""):
            grad, inp = (memory_format(t) for t in op.inputs[:2])
            formats[grad if grad == inp else f"{grad} gradient, {inp} input"] += 1
    return formats


def peak_memory(graph, sched) -> int:
    """Inductor's own estimate of the graph's peak buffer memory in bytes (torch._inductor.memory, as its
    reorder_for_peak_memory plans it): the buffers it allocates, each from its first writer to its last reader;
    the graph's outputs are not counted (for perf's joint graph, the gradients; for torch.compile's forward, the
    activations it saves for the backward)."""
    from torch._inductor import memory
    from torch.utils._ordered_set import OrderedSet

    peak, _ = memory.prepare_planning_info(sched.nodes, sched.name_to_buf, sched.name_to_fused_node,
                                           OrderedSet(graph.graph_inputs), OrderedSet(graph.get_output_names()))
    return int(peak)


def summarize(graph) -> dict:
    from torch._inductor import scheduler as s

    graph.init_wrapper_code()
    conv_backward = backward_conv_formats(graph)
    fused, nbytes, mix_order, extern = 0, 0, 0, collections.Counter()
    sched = s.Scheduler(graph.operations)
    for node in sched.nodes:
        if isinstance(node, s.ExternKernelSchedulerNode):
            name = getattr(node.node, "python_kernel_name", None) or type(node.node).__name__
            extern[str(name).replace("extern_kernels.", "")] += 1
        elif not isinstance(node, s.NopKernelSchedulerNode):
            fused += 1
            nbytes += int(node.get_read_write_buffers_sizes())
            mix_order += isinstance(node, s.FusedMixOrderReductions)
    return {"fused": fused, "bytes": nbytes, "mix_order": mix_order, "extern": extern,
            "layout_opt": bool(graph.layout_opt), "conv_backward": conv_backward, "peak": peak_memory(graph, sched)}


PERF, COMPILE = "perf package (AOTInductor, joint graph)", "torch.compile (forward + backward)"


def perf_plans(models, job, size, batch, amp, channels_last) -> list:
    """The exporter's training graph (traced on the CPU as export_train traces it), exported again on fake CUDA
    tensors and lowered through the exporter's own compile_and_package."""
    with mock.patch.object(exporter, "_probe", fake_probe):
        program, configs = sim.exported_graph(exporter, lambda: exporter.export_train(
            models.make(job, size), models.loss, list(batch), "never.pt2", channels_last=channels_last, amp=amp,
            attention="autocast"))  # "fastest" measures on the CPU
    simulate_codegen()
    plans = []
    with sim.planned_only(exporter, plans, summary=summarize):
        exporter.compile_and_package(sim.on_fake_cuda(program), "never.pt2", {**configs, "fx_graph_cache": False})
    return plans


def compile_plans(models, job, size, batch, amp, channels_last) -> list:
    """torch.compile's path: dynamo's graph of the loss, AOTAutograd's forward and backward (traced on the CPU),
    each retargeted to CUDA and lowered by Inductor's compile_fx_inner on fake CUDA inputs."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    simulate_codegen()
    model = models.make(job, size).train()
    x, y = batch
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x

    def step(a, b):
        with torch.autocast("cpu", torch.bfloat16, enabled=amp == "bf16"):
            return models.loss(model, a, b)

    got = {}

    def capture(gm, inputs):
        got["gm"], got["inputs"] = gm, inputs
        return fake_run(gm)

    torch._dynamo.reset()
    torch.compile(step, backend=capture)(x, y)
    plans = []

    def inner(gm, inputs, **kwargs):
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(tracked_fakes=[]))
        with mode:
            fakes = [sim.fake_cuda_like(t) if isinstance(t, torch.Tensor) else t for t in inputs]
        with sim.planned_only(exporter, plans, summary=summarize), \
                torch._guards.tracing(torch._guards.TracingContext(mode)):
            compile_fx_inner(sim.on_cuda_devices(copy.deepcopy(gm)), fakes, **kwargs)
        return make_boxed_func(gm)

    # The backward is lowered with the forward (not at the first backward), so nothing runs.
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        compile_fx(got["gm"], list(got["inputs"]), inner_compile=inner)
    return plans


def fake_probe(fn, *args):
    """The exporter's eager runs on the example batch (export_compiled._probe), on fake tensors: sizes, strides
    and dtypes are what the plan needs, and the real runs cost minutes on a CPU without native bf16."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        return fn(*args)


def fake_run(gm):
    """What dynamo calls in place of the captured graph: the graph run on fake copies of its inputs, answered
    with uninitialised real tensors of the outputs' sizes, strides and dtypes. The step's result is not used,
    and running it for real costs minutes on a CPU without native bf16 (the e2e CNN at CUDA size)."""

    def run(*args):
        outs = fake_probe(gm, *args)
        return type(outs)(torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
                          if isinstance(o, torch.Tensor) else o for o in outs)

    return run


def totals(plans) -> dict:
    extern, conv_backward = collections.Counter(), collections.Counter()
    for p in plans:
        extern.update(p["extern"])
        conv_backward.update(p["conv_backward"])
    return {"fused": sum(p["fused"] for p in plans), "bytes": sum(p["bytes"] for p in plans),
            "mix_order": sum(p["mix_order"] for p in plans), "extern": extern, "conv_backward": conv_backward}


def check(perf: dict, compiled: dict, slack: float) -> list:
    """Where perf's plan does more than torch.compile's: other extern kernels, or more fused kernels or bytes
    than `slack` (a fraction) allows."""
    problems = []
    if perf["extern"] != compiled["extern"]:
        problems.append(f"extern kernels differ: perf {dict(perf['extern'])}, torch.compile {dict(compiled['extern'])}")
    if perf["conv_backward"] != compiled["conv_backward"]:
        problems.append(f"convolution backwards take other layouts: perf {dict(perf['conv_backward'])}, "
                        f"torch.compile {dict(compiled['conv_backward'])}")
    for key, what in (("fused", "fused kernels"), ("bytes", "bytes read + written")):
        if perf[key] > compiled[key] * (1 + slack):
            problems.append(f"{what}: perf {perf[key]}, torch.compile {compiled[key]} (allowed {slack:.0%} more)")
    return problems


def row(label, plans) -> str:
    t = totals(plans)
    listed = lambda counts: ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"  # noqa: E731
    peaks = ", ".join(f"{p['peak'] / 2**30:.2f}" if "peak" in p else "-" for p in plans)  # older --save files: none
    return (f"| {label} | {len(plans)} | {', '.join('on' if p['layout_opt'] else 'off' for p in plans)} | "
            f"{t['fused']} | {t['bytes'] / 1e6:.0f} | {t['mix_order']} | {listed(t['extern'])} | "
            f"{listed(t['conv_backward'])} | {peaks} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default="cnn", choices=["cnn", "transformer", "mlp"])
    parser.add_argument("--batch", type=int, default=8, help="samples per step (default 8: the plan's shape "
                                                              "does not depend on it; bytes scale with it)")
    parser.add_argument("--amp", default="off", choices=["off", "bf16"])
    parser.add_argument("--layout", default="channels-last", choices=["channels-last", "contiguous"])
    parser.add_argument("--side", default="both", choices=["both", "perf", "compile"])
    parser.add_argument("--save", metavar="FILE", help="also write the plans made to FILE (JSON), for --load")
    parser.add_argument("--load", metavar="FILE", action="append", default=[],
                        help="plan nothing: read the plans --save wrote (once per file, e.g. one per side)")
    parser.add_argument("--check", type=float, metavar="FRACTION",
                        help="exit 1 where perf's plan has other extern kernels than torch.compile's, or more "
                             "fused kernels or bytes than this fraction more (0.15: 15%%)")
    a = parser.parse_args(argv)
    if a.load and a.save:
        parser.error("--save writes plans made here, --load plans nothing: use one of them")
    if a.check is not None and not a.load and a.side != "both":
        parser.error("--check compares both sides: plan both (--side both), or --load both sides' files")
    plans = {}
    if a.load:
        step = None
        for path in a.load:
            with open(path) as f:
                saved = json.load(f)
            if step is not None and saved["step"] != step:
                parser.error(f"--load {path}: plans of another step ({saved['step']}) than the files before "
                             f"it ({step})")
            step = saved["step"]
            for label, side in saved["plans"].items():
                plans[label] = [{**p, "extern": collections.Counter(p["extern"]),
                                 "conv_backward": collections.Counter(p["conv_backward"])} for p in side]
    else:
        models = e2e_models()
        size = dict(models.JOBS[a.job]["cuda"])
        torch.manual_seed(0)
        x, y = models.make_data(a.job, size, a.batch)
        channels_last = a.layout == "channels-last"
        step = {"job": a.job, "batch": a.batch, "amp": a.amp, "layout": a.layout}
        if a.side in ("both", "perf"):
            plans[PERF] = perf_plans(models, a.job, size, (x, y), a.amp, channels_last)
        if a.side in ("both", "compile"):
            plans[COMPILE] = compile_plans(models, a.job, size, (x, y), a.amp, channels_last)
        if a.save:
            with open(a.save, "w") as f:
                json.dump({"step": step, "plans": plans}, f)
    if a.check is not None and set(plans) != {PERF, COMPILE}:
        parser.error("--check compares both sides: plan both (--side both), or --load both sides' files")
    print(f"{step['job']} (CUDA size, batch {step['batch']}), amp {step['amp']}, {step['layout']}, "
          "simulated H100:\n")
    print("| step | graphs | layout optimization | fused kernels | MB read + written by them | of them mix-order "
          "reductions | extern kernels | convolution backwards' layout | peak memory of each graph's buffers, GiB "
          "(Inductor's estimate, the graph's outputs left out: torch.compile's forward returns what it saves) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(row(label, plans[label]) for label in (PERF, COMPILE) if label in plans))
    if a.check is not None:
        problems = check(totals(plans[PERF]), totals(plans[COMPILE]), a.check)
        for problem in problems:
            print("kernel_plans: perf's plan does more:", problem, file=sys.stderr)
        if problems or any(not p for p in plans.values()):
            sys.exit(1)


if __name__ == "__main__":
    main()
