"""Export the CompiledModel tests' packages and their eager references into OUT.

Exporting takes about a minute per model on 2 cores, so results are cached under
$PERF_CACHE_DIR (default ~/.cache/perf), keyed on the sources and torch's version.
Writes OUT/<name>.pt2 and OUT/<name>.ref.pt (inputs and eager outputs for batch 1
and 5, read back by tests/test_compiled.cpp), OUT/mlp_autotuned.pt2 (the MLP exported
with --max-autotune for batch 5), OUT/mlp_scalar.pt2 (the same for batch 5 with one
more Inductor option, cpp.simdlen=1: kernels without SIMD), OUT/mlp_cuda_marked.pt2 (the MLP
package relabelled as a CUDA one), OUT/cnn_plain.pt2 (the CNN exported without
perf's tool, as PyTorch's docs show), OUT/cnn_plain_nosource.pt2 (the same
without its generated source) and OUT/stamp.

Training packages (tools/export_compiled.py --train, for perf::CompiledTrainStep):
OUT/<name>.pt2 and OUT/<name>.ref.pt holding the initial state, STEPS batches,
Python eager training's loss, state (before the step) and gradients per step
(torch.optim.AdamW), the final state and an eval() forward of the trained model
(tests/test_compiled_train.cpp); OUT/mlp_train_scalar.pt2, the MLP's step for
batch 8 exported with cpp.simdlen=1 (no reference of its own: mlp_train's). OUT/example_net_train.pt2:
examples/compiled_train.py's step, exported by the tool's command line as that file's header says (batch 64), for
the test example_compiled_train_learns (its CUDA twin: make_cuda_packages.py).

The exports run in processes of their own, half as many at once as there are cores
(PERF_EXPORT_JOBS sets how many).
"""
import argparse
import concurrent.futures
import hashlib
import io
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import zipfile

import torch
import torch._inductor.config

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "tools", "export_compiled.py")
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "compiled_train.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(TOOL))
import models  # noqa: E402
from export_compiled import AMP, AttentionPrecision, export_compiled, export_train, shared_cxx_runtime  # noqa: E402

STEPS = 50
LR, WEIGHT_DECAY, DROPOUT_SEED = 1e-2, 0.01, 7

# name -> (factory, example inputs for one sample (batch dim added), dynamic batch)
def specs():
    return {
        "mlp": (models.make_mlp, lambda b: (torch.randn(b, 16),)),
        "cnn": (models.make_cnn, lambda b: (torch.randn(b, 3, 32, 32),)),
        "two_in_two_out": (models.make_two_in_two_out,
                           lambda b: (torch.randint(0, 50, (b, 12)), torch.randn(b, 8))),
    }


# name -> (factory, batch(n) -> (x, y), batch size, dynamic batch, amp, channels-last, attention)
def train_specs():
    # Learnable data, so that a test can also see the loss fall.
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 4, generator=g)
    colors = torch.randn(10, 3, generator=g)

    def rows(n):
        x = torch.randn(n, 16)
        return x, (x @ w).argmax(1)

    def images(n):
        y = torch.randint(0, 10, (n,))
        return torch.randn(n, 3, 32, 32) + colors[y][:, :, None, None], y

    def tokens(n):  # each next token follows from the current one
        t = torch.randint(0, 32, (n, 1))
        for _ in range(8):
            t = torch.cat([t, (t[:, -1:] * 5 + 3) % 32], 1)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    return {
        "mlp_train": (models.make_mlp, rows, 8, (2, 64), "off", False, "fastest"),
        "cnn_train": (models.make_cnn, images, 8, None, "off", False, "fastest"),
        "gpt_train": (models.make_tiny_gpt, tokens, 4, None, "off", False, "fastest"),
        "cnn_train_cl_bf16": (models.make_cnn, images, 8, None, "bf16", True, "fastest"),
        # bf16 autocast with the attention in float32 (export_train's attention="float32"); Python's run
        # below uses the same AttentionPrecision, as perf::Autocast's set_cpu_attention("float32") does in C++.
        "gpt_train_bf16": (models.make_tiny_gpt, tokens, 4, None, "bf16", False, "float32"),
    }


def train_reference(factory, make_batch, batch, amp, channels_last, attention):
    """Python eager training: the losses and state perf::CompiledTrainStep must reproduce."""
    torch.manual_seed(0)
    model = factory().train()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    batches = [make_batch(batch) for _ in range(STEPS)]
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, states, grads = [], [], []
    torch.manual_seed(DROPOUT_SEED)
    precision = AttentionPrecision("cpu", attention if attention == "float32" else "autocast")
    for x, y in batches:
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        states.append({k: v.clone().contiguous() for k, v in model.state_dict().items()})
        opt.zero_grad(set_to_none=True)
        with precision, torch.autocast("cpu", dtype=AMP[amp] or torch.bfloat16, enabled=amp != "off"):
            loss = models.classify_loss(model, x, y)
        loss.backward()
        grads.append({k: p.grad.clone().contiguous() for k, p in model.named_parameters()})
        opt.step()
        losses.append(loss.detach().float())
    model.eval()
    with torch.no_grad():
        eval_in = batches[0][0]
        eval_out = model(eval_in)
    return {"init": init, "x": [b[0] for b in batches], "y": [b[1] for b in batches], "losses": torch.stack(losses),
            "states": states, "grads": grads,
            "final": {k: v.clone().contiguous() for k, v in model.state_dict().items()}, "eval_in": eval_in,
            "eval_out": eval_out}


def export_train_package(out: str, name: str) -> None:
    factory, make_batch, batch, dynamic, amp, channels_last, attention = train_specs()[name]
    torch.save(train_reference(factory, make_batch, batch, amp, channels_last, attention),
               os.path.join(out, f"{name}.ref.pt"))
    torch.manual_seed(0)
    export_train(factory(), models.classify_loss, make_batch(batch), os.path.join(out, f"{name}.pt2"),
                 dynamic_batch=dynamic, amp=amp, channels_last=channels_last, attention=attention)


def cache_key() -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for f in (TOOL, os.path.join(HERE, "models.py"), EXAMPLE, __file__):
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]


def export_inference_package(out: str, name: str) -> None:
    factory, make_inputs = specs()[name]
    torch.manual_seed(0)
    model = factory().eval()
    torch.manual_seed(1)
    ref = {}
    with torch.no_grad():
        for b in (1, 5):
            xs = make_inputs(b)
            ys = model(*xs)
            ys = list(ys) if isinstance(ys, tuple) else [ys]
            ref[f"b{b}_in"] = list(xs)
            ref[f"b{b}_out"] = ys
    torch.save(ref, os.path.join(out, f"{name}.ref.pt"))
    export_compiled(model, make_inputs(4), os.path.join(out, f"{name}.pt2"), dynamic_batch=(1, 64))


def export_mlp_autotuned(out: str) -> None:
    # The MLP autotuned (Inductor benchmarks its GEMM templates against ATen's), static shapes for batch 5.
    torch.manual_seed(0)
    export_compiled(models.make_mlp().eval(), (torch.randn(5, 16),), os.path.join(out, "mlp_autotuned.pt2"),
                    dynamic_batch=None, max_autotune=True)


def export_mlp_scalar(out: str) -> None:
    # The MLP with an Inductor option passed through (inductor_configs): scalar kernels, for batch 5.
    torch.manual_seed(0)
    export_compiled(models.make_mlp().eval(), (torch.randn(5, 16),), os.path.join(out, "mlp_scalar.pt2"),
                    dynamic_batch=None, inductor_configs={"cpp.simdlen": 1})


def export_mlp_train_scalar(out: str) -> None:
    # ...and its training step exported with the same option, for batch 8.
    torch.manual_seed(0)
    export_train(models.make_mlp(), models.classify_loss, (torch.randn(8, 16), torch.zeros(8, dtype=torch.int64)),
                 os.path.join(out, "mlp_train_scalar.pt2"), inductor_configs={"cpp.simdlen": 1})


def export_cnn_plain(out: str) -> None:
    # The CNN exported the way PyTorch's docs show, without perf's tool (so without perf's metadata), and
    # the same package with its generated source removed (nothing left to read input specs from).
    torch.manual_seed(0)
    cnn = models.make_cnn().eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(cnn, (torch.randn(4, 3, 32, 32),), dynamic_shapes=({0: batch},))
    # (Only the exporter's link option for the shared C++ runtime: without it, where the compiler links the static
    # one, the package crashes when loaded next to torch. export_compiled.shared_cxx_runtime says why.)
    plain = torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(out, "cnn_plain.pt2"),
                                                     inductor_configs=shared_cxx_runtime())
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(os.path.join(out, "cnn_plain_nosource.pt2"), "w") as zout:
        for item in zin.infolist():
            if not item.filename.endswith(".wrapper.cpp"):
                zout.writestr(item, zin.read(item.filename))


def export_example_train(out: str) -> None:
    # The command a user of examples/compiled_train runs (its header comment), on the CPU.
    subprocess.run([sys.executable, TOOL, f"{EXAMPLE}:make", "--train", "--loss", f"{EXAMPLE}:loss", "--input", "64,64",
                    "--input", "64:int64", "--device", "cpu", "-o", os.path.join(out, "example_net_train.pt2")],
                   check=True)


def tasks() -> list:
    """(function, arguments after `out`) for every export, the training steps (the slowest) first."""
    return ([(export_train_package, (name,)) for name in train_specs()] +
            [(export_inference_package, (name,)) for name in specs()] +
            [(export_mlp_autotuned, ()), (export_mlp_scalar, ()), (export_mlp_train_scalar, ()),
             (export_cnn_plain, ()), (export_example_train, ())])


def run_task(out: str, threads: int, index: int) -> float:
    torch.set_num_threads(threads)
    # No compile pool: the exports already run side by side, and Inductor's default pool is a process per
    # core in each (on a 16-core GPU machine, 8 exports starting 128 processes that import torch, beside
    # the C++ build); an AOTInductor CPU export compiles its code in one compiler process anyway.
    torch._inductor.config.compile_threads = 1
    started = time.time()
    fn, args = tasks()[index]
    fn(out, *args)
    return time.time() - started


def build(out: str) -> None:
    # Each export is one process's work (tracing, then mostly one compiler process), independent of the
    # others (each seeds its own draws): half the cores run them at once, each with its share of threads
    # for the eager references. A 16-core machine exported them one by one in 272 s.
    todo = tasks()
    jobs = os.environ.get("PERF_EXPORT_JOBS", "")
    if jobs and not (jobs.isdigit() and int(jobs) > 0):
        raise SystemExit(f"PERF_EXPORT_JOBS must be a whole number of exports at once > 0, got {jobs!r}")
    workers = int(jobs) if jobs else max(1, (os.cpu_count() or 2) // 2)
    workers = min(workers, len(todo))
    threads = max(1, (os.cpu_count() or 1) // workers)
    started = time.time()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = [pool.submit(run_task, out, threads, i) for i in range(len(todo))]
        for (fn, args), run in zip(todo, runs):
            print(f"  {fn.__name__}{'(' + ', '.join(args) + ')' if args else ''}: {run.result():.0f} s", flush=True)
    print(f"exported {len(todo)} packages in {time.time() - started:.0f} s ({workers} at once)", flush=True)
    # CUDA packages without compiling one: the MLPs with their device key changed.
    for name in ("mlp", "mlp_train"):
        src, dst = os.path.join(out, f"{name}.pt2"), os.path.join(out, f"{name}_cuda_marked.pt2")
        with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
            for item in zin.infolist():
                data = zin.read(item.filename)
                if item.filename.endswith("wrapper_metadata.json"):
                    data = data.replace(b'"AOTI_DEVICE_KEY": "cpu"', b'"AOTI_DEVICE_KEY": "cuda"')
                    assert b'"cuda"' in data, data
                zout.writestr(item, data)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    cache_root = os.environ.get("PERF_CACHE_DIR", os.path.expanduser("~/.cache/perf"))
    cached = os.path.join(cache_root, "aoti-test-packages", cache_key())
    if not os.path.exists(os.path.join(cached, "stamp")):
        tmp = cached + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        build(tmp)
        open(os.path.join(tmp, "stamp"), "w").write(torch.__version__ + "\n")
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
        print(f"exported test packages into {cached}")
    else:
        print(f"test packages from the cache {cached}")
    os.makedirs(a.out, exist_ok=True)
    for f in os.listdir(cached):
        shutil.copy2(os.path.join(cached, f), os.path.join(a.out, f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
