"""Export the CUDA tests' packages at build time, on a machine with a GPU.

The GPU tests of perf::CompiledModel and perf::CompiledTrainStep run packages
compiled by Inductor for the GPU they run on, exported with the tool a user
runs (tools/export_compiled.py). Exported inside the tests, each export (30-60 s)
would count against the test's time, and again in gpu-check's one-process run;
exported here, beside the compilation, the tests find them in OUT:

    OUT/mlp_cuda.pt2          the MLP for inference, batch 1..64
    OUT/cnn_cl_frozen_cuda.pt2  the CNN for inference, channels-last, parameters frozen, batch 8
    OUT/mlp_train_cuda.pt2    the MLP's training step, batch 8
    OUT/cnn_train_cl_cuda.pt2 the CNN's training step, bf16 autocast and channels-last, batch 8
    OUT/cnn_train_bf16_cuda.pt2     the same without channels-last
    OUT/cnn_train_cl_fp32_cuda.pt2  the same with channels-last, without autocast
    OUT/gpt_train_cuda.pt2    the test transformer's training step (dropout), batch 4 of 8 tokens
    OUT/cnn_train_cl_fp32_code_cuda.pt2  the channels-last fp32 step again, with TORCH_LOGS=output_code:
                              no test uses it; its log holds the code each compilation generated
                              (AOTInductor's C++ wrapper, and where the exporter refuses the package,
                              the Python and C++ wrappers of its diagnosis), to read where the bug is
    OUT/example_net_train_cuda.pt2  examples/compiled_train.py's step, exported as its header
                              says (batch 64): for the test example_compiled_train_learns
    OUT/<name>.log            each export's output
    OUT/stamp                 what was done

Without a CUDA device only the stamp is written, and the tests export the
packages themselves. When an export fails, its line in the stamp says so and
the tests that need the package fail with its log, without exporting it again
(test_util::cuda_test_package): a failure shows in the test that needs it. This
script never fails the build.
"""
import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "tools", "export_compiled.py")
MODELS = os.path.join(HERE, "models.py")
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "compiled_train.py")

# The same arguments as the tests' own exports (tests/test_compiled.cpp, tests/test_compiled_train.cpp,
# and example_compiled_train_learns in tests/CMakeLists.txt).
EXPORTS = {
    "mlp_cuda.pt2": [f"{MODELS}:make_mlp", "--input", "4,16", "--dynamic-batch", "1:64", "--device", "cuda"],
    "cnn_cl_frozen_cuda.pt2": [f"{MODELS}:make_cnn_frozen", "--input", "8,3,32,32", "--dynamic-batch", "static",
                               "--device", "cuda", "--channels-last"],
    "mlp_train_cuda.pt2": [f"{MODELS}:make_mlp", "--train", "--loss", f"{MODELS}:classify_loss", "--input", "8,16",
                           "--input", "8:int64", "--device", "cuda"],
    "cnn_train_cl_cuda.pt2": [f"{MODELS}:make_cnn", "--train", "--loss", f"{MODELS}:classify_loss", "--input",
                              "8,3,32,32", "--input", "8:int64", "--device", "cuda", "--amp", "bf16",
                              "--channels-last"],
    "cnn_train_bf16_cuda.pt2": [f"{MODELS}:make_cnn", "--train", "--loss", f"{MODELS}:classify_loss", "--input",
                                "8,3,32,32", "--input", "8:int64", "--device", "cuda", "--amp", "bf16"],
    "cnn_train_cl_fp32_cuda.pt2": [f"{MODELS}:make_cnn", "--train", "--loss", f"{MODELS}:classify_loss", "--input",
                                   "8,3,32,32", "--input", "8:int64", "--device", "cuda", "--channels-last"],
    "gpt_train_cuda.pt2": [f"{MODELS}:make_tiny_gpt", "--train", "--loss", f"{MODELS}:classify_loss", "--input",
                           "4,8:int64", "--input", "4,8:int64", "--device", "cuda"],
    "cnn_train_cl_fp32_code_cuda.pt2": [f"{MODELS}:make_cnn", "--train", "--loss", f"{MODELS}:classify_loss",
                                        "--input", "8,3,32,32", "--input", "8:int64", "--device", "cuda",
                                        "--channels-last"],
    "example_net_train_cuda.pt2": [f"{EXAMPLE}:make", "--train", "--loss", f"{EXAMPLE}:loss", "--input", "64,64",
                                   "--input", "64:int64", "--device", "cuda"],
}

DIAGNOSTIC = {"cnn_train_cl_fp32_code_cuda.pt2"}
# More environment for an export: Inductor's generated code into its log.
ENV = {"cnn_train_cl_fp32_code_cuda.pt2": {"TORCH_LOGS": "output_code"}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for f in os.listdir(a.out):
        os.remove(os.path.join(a.out, f))
    stamp = os.path.join(a.out, "stamp")
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception as e:  # noqa: BLE001  (reported; the tests export themselves)
        has_cuda, why = False, f"torch could not be imported or initialised ({type(e).__name__}: {e})"
    else:
        why = "no CUDA device on this machine at build time"
    if not has_cuda:
        with open(stamp, "w") as f:
            f.write(f"skipped: {why}; the CUDA tests export their packages themselves\n")
        return 0
    # All at once: each is mostly one compiler process.
    started, runs = time.time(), {}
    for name, args in EXPORTS.items():
        log = open(os.path.join(a.out, name[:-4] + ".log"), "w")
        cmd = [sys.executable, TOOL, *args, "-o", os.path.join(a.out, name[:-4] + ".tmp.pt2")]
        # Inductor's compile pool (Triton's kernels) split between the exports running at once, rather than
        # a process per core in each of them.
        threads = {"TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 1) // len(EXPORTS)))}
        env = {**threads, **os.environ, **ENV.get(name, {})}
        runs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
    lines = []
    for name, (proc, log) in runs.items():
        try:
            rc = proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timed out after 900 s"
        log.close()
        if rc == 0:
            os.replace(os.path.join(a.out, name[:-4] + ".tmp.pt2"), os.path.join(a.out, name))
            lines.append(f"{name}: exported")
        else:
            then = "no test uses it" if name in DIAGNOSTIC else (
                "its tests fail with this log, or skip quoting it where the exporter blames AOTInductor")
            lines.append(f"{name}: FAILED ({rc}; see {name[:-4]}.log); {then}")
            print(f"warning: exporting the CUDA test package {name} failed ({rc}); see {log.name}", file=sys.stderr)
    lines.append(f"{time.time() - started:.0f} s")
    with open(stamp, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("CUDA test packages: " + "; ".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
