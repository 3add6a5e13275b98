"""bench/e2e's profile (run.py --profile-steps): trace_table.py's arithmetic on hand-made GPU and CPU traces, the
reasons run.py gives where a configuration has no trace, what run.py shows and keeps of a C++ run that fails (its
error without LibTorch's backtrace frames; the whole stderr in <out>), then a real --check run of the MLP job,
Python and C++ each tracing 2 steps after their timed ones, read back from <out>/profile-mlp.md, and report.py's
tables of that run's rows, with and without Python eager fp32, with a failed run's row, and of runs kept (--keep)
and merged; run.py --diagnose running a failed C++ run again with cuDNN's benchmark mode off. Run by ctest
(three tests that share DIR: e2e_profile_failures and e2e_profile_run at once, then e2e_profile_tables on what they
wrote; as one test, 36 s alone on the 2-core VM, it took 58 s in CI two tests at a time and 75 s on a GPU machine's
host):

    python tests/e2e_profile_check.py --e2e build/bench/e2e --out DIR [--part failures|run|tables]

Without --part, all three parts, one after the other.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
E2E = os.path.join(HERE, "..", "bench", "e2e")
sys.path.insert(0, E2E)
import trace_table  # noqa: E402


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def near(a, b):
    return abs(a - b) < 1e-9


def x(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def trace(events):
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"traceEvents": events}, f)
    f.close()
    return f.name


def hand_made():
    steps = x("user_annotation", trace_table.RANGE, 1000, 1000)
    # GPU: A twice, B on another stream overlapping A's first call, a copy; one kernel before the range.
    gpu = trace([steps, x("kernel", "A", 1100, 200, 7), x("kernel", "B", 1150, 100, 8), x("kernel", "A", 1500, 200, 7),
                 x("gpu_memcpy", "Memcpy HtoD", 1800, 50, 7), x("kernel", "before", 500, 100, 7),
                 x("cpu_op", "aten::mm", 1100, 400)])
    s = trace_table.summarize(gpu, 2)
    check(s["device"] == "cuda", f"kernels make a GPU summary: {s}")
    check(near(s["wall_ms"], 0.5), f"1 ms over 2 steps: {s['wall_ms']}")
    check(near(s["busy_ms"], 0.225), f"busy: the union 1100-1300, 1500-1700, 1800-1850 over 2 steps: {s['busy_ms']}")
    check(near(s["events"], 2.0), f"4 device events over 2 steps, the one before the range left out: {s['events']}")
    check([r[0] for r in s["rows"]] == ["A", "B", "Memcpy HtoD"], f"rows by device time: {s['rows']}")
    name, calls, ms, share = s["rows"][0]
    check(near(calls, 1.0) and near(ms, 0.2) and near(share, 400 / 550), f"A: 2 calls, 400 us of 550: {s['rows'][0]}")
    check("GPU busy 0.23 ms (45%), 2 kernels/step" in trace_table.line("x", s), trace_table.line("x", s))
    # Device time by kind: a kernel of each kind (a Triton kernel whose name says convolution_backward among them),
    # a second Triton kernel on another stream, a memset; a second summary without some kinds.
    named = [("triton_poi_fused_add_convolution_backward_0", 10), ("sm90_xmma_dgrad_implicit_gemm_bf16bf16", 20),
             ("sm90_xmma_gemm_bf16bf16_bf16f32", 30), ("pytorch_flash::flash_fwd_kernel", 40),
             ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 50),
             ("void at::native::vectorized_elementwise_kernel<4>", 60)]
    kinds = trace_table.summarize(trace([steps] + [x("kernel", n, 1100 + 100 * i, d, 7) for i, (n, d) in enumerate(named)]
                                        + [x("gpu_memset", "Memset (Device)", 1900, 5, 7),
                                           x("kernel", "triton_red_fused_1", 1100, 10, 8)]), 1)
    want = {"fused (Triton)": (2, 0.02), "convolutions (cuDNN)": (1, 0.02), "matmuls": (1, 0.03),
            "attention": (1, 0.04), "optimizer (multi-tensor)": (1, 0.05), "other ATen kernels": (1, 0.06),
            "copies and sets": (1, 0.005)}
    check(kinds["kinds"].keys() == want.keys() and all(near(kinds["kinds"][k][0], c) and near(kinds["kinds"][k][1], ms)
                                                      for k, (c, ms) in want.items()), f"kinds: {kinds['kinds']}")
    fewer = trace_table.summarize(trace([steps, x("kernel", "triton_poi_fused_2", 1100, 30, 7),
                                         x("kernel", "sm90_xmma_fprop_implicit_gemm", 1200, 40, 7)]), 2)
    table = trace_table.markdown("cnn", [("C++", kinds), ("Python", fewer)]).splitlines()
    header = ("| configuration | fused (Triton) | attention | convolutions (cuDNN) | matmuls | optimizer (multi-tensor) | "
              "other ATen kernels | copies and sets |")
    check(header in table and "| C++ | 0.02 (2) | 0.04 (1) | 0.02 (1) | 0.03 (1) | 0.05 (1) | 0.06 (1) | 0.01 (1) |"
          in table and "| Python | 0.01 (0.5) | - | 0.02 (0.5) | - | - | - | - |" in table, "\n".join(table))
    # CPU: P holds C, which holds G, on thread 1; Q on thread 2 at the same time.
    cpu = trace([steps, x("cpu_op", "P", 1100, 500), x("cpu_op", "C", 1200, 200), x("cpu_op", "G", 1250, 50),
                 x("cpu_op", "Q", 1100, 300, 2)])
    s = trace_table.summarize(cpu, 1)
    check(s["device"] == "cpu", f"no kernels: a CPU summary: {s}")
    self_ms = {name: ms for name, _, ms, _ in s["rows"]}
    check(all(near(self_ms[k], v) for k, v in {"P": 0.3, "Q": 0.3, "C": 0.15, "G": 0.05}.items()),
          f"self times P 300, Q 300, C 150, G 50 us: {self_ms}")
    check(near(s["busy_ms"], 0.8), f"self times add up to the operators' time: {s['busy_ms']}")
    try:
        trace_table.summarize(trace([x("kernel", "A", 1100, 200)]), 1)
        check(False, "a trace without the profiled range is refused")
    except ValueError as e:
        check("0 'e2e_profiled_steps' ranges, expected 1" in str(e), str(e))
    table = trace_table.markdown("mlp", [("C++ stock", s), ("Python", "OSError: no trace")])
    check("| C++ stock | 1.00 | 0.80 | 4 |" in table and "| Python | no profile: OSError: no trace |" in table, table)
    hand_made_calls()
    hand_made_diff()


def hand_made_calls():
    """--calls (bench_compiled's --profile-traces): each call in its own range, its operations those from its start
    to the next call's; the median call by its total, split into the device's start, span, busy union and gaps."""
    def call(name, at, host, ops):  # ops: (name, start after `at`, duration)
        return [x("user_annotation", trace_table.CALL + name, at, host)] + [x("kernel", n, at + t, d, 7) for n, t, d in ops]
    # R: three calls of 100 us on the host; the device starts 20 / 30 / 40 us in. In the median one (30 us in):
    # copy 30-35, K1 40-100, K2 on another stream 90-110 (overlapping K1), K3 150-160: 130 us span, 85 us busy,
    # gaps of 5 us before K1 and 40 before K3. S: one call whose kernel ends past the range, and an operation in
    # no call's time (before the first range). A range with no operation (T) is no call.
    median = [("copy", 30, 5), ("K1", 40, 60), ("K2", 90, 20), ("K3", 150, 10)]
    events = (call("R at batch 1", 1000, 100, [("copy", 20, 5), ("K1", 30, 60)])
              + call("R at batch 1", 2000, 100, median)
              + call("R at batch 1", 3000, 100, [("copy", 40, 5), ("K1", 50, 200)])
              + call("S at batch 1", 4000, 50, [("L", 10, 300)]) + call("T", 5000, 10, [])
              + [x("kernel", "stray", 500, 10, 7), x("cpu_op", "aten::copy_", 2000, 5)])
    got = trace_table.calls(trace(events))
    check(sorted(got) == ["R at batch 1", "S at batch 1"], f"the configurations with operations: {sorted(got)}")
    r = got["R at batch 1"]
    want = {"calls": 3, "total_us": 160, "host_us": 100, "start_us": 30, "span_us": 130, "busy_us": 85,
            "operations": 4, "gaps": [(40, "K3"), (5, "K1")]}
    check(r == want, f"the median call of R: {r}, want {want}")
    s = got["S at batch 1"]
    check(s["total_us"] == 310 and s["span_us"] == 300 and s["gaps"] == [], f"S: {s}")
    check(trace_table.calls_line("R at batch 1", r) == (
        "calls of R at batch 1: 160.0 us a call (median of 3): the device starts 30.0 us in (the call takes 100.0 us "
        "on the host), then spans 130.0 us, busy 85.0 us, idle 45.0 us between 4 operations; widest gaps: 40.0 us "
        "before K3; 5.0 us before K1"), trace_table.calls_line("R at batch 1", r))
    out = subprocess.run([sys.executable, os.path.join(E2E, "trace_table.py"), "--calls", trace(events),
                          trace([x("kernel", "K", 0, 1, 7)])], capture_output=True, text=True, timeout=60)
    check(out.returncode == 0 and out.stdout.count("\ncalls of ") + out.stdout.startswith("calls of ") == 2
          and "no 'call: ...' range with device operations in it" in out.stdout, f"{out.stdout}{out.stderr}")


def hand_made_diff():
    """--diff: two traces of one configuration each, their median calls compared operation by operation."""
    def call(name, at, host, ops):  # ops: (name, start after `at`, duration[, grid])
        return [x("user_annotation", trace_table.CALL + name, at, host)] + [
            dict(x("kernel", o[0], at + o[1], o[2], 7), args={"grid": list(o[3] if len(o) > 3 else (1, 1, 1)),
                                                              "block": [128, 1, 1]}) for o in ops]
    # A: copy 10-12, K1 13-53, K2 54-94. B: the device starts 15 us later (copy 25-27), K1 28-68, then K2 a further
    # 6 us later (75-115): 21 us more a call, 15 of them before the first operation and 6 idle.
    fast = trace(call("fast", 0, 30, [("copy", 10, 2), ("K1", 13, 40), ("K2", 54, 40)]))
    slow = trace(call("slow", 0, 30, [("copy", 25, 2), ("K1", 28, 40), ("K2", 75, 40)]))
    got = trace_table.diff(fast, slow)
    want = ("diff of slow (115.0 us a call) against fast (94.0 us): +21.0 us; the device's start +15.0 us, busy "
            "+0.0 us, idle +6.0 us; 3 against 3 operations\n"
            "the same operations in the same order, with the same grids and blocks\n"
            "gaps that grew the most: +15.0 us before #0 copy; +6.0 us before #2 K2")
    check(got == want, f"--diff of the same operations:\n{got}\nwant\n{want}")
    other = trace(call("other", 0, 30, [("copy", 10, 2), ("K1", 13, 40, (2, 1, 1)), ("K2", 54, 40)]))
    got = trace_table.diff(fast, other).splitlines()[1]
    check(got == "first difference at operation #1: K1 grid [1, 1, 1] block [128, 1, 1] against K1 grid [2, 1, 1] "
                 "block [128, 1, 1]", got)
    fewer = trace(call("fewer", 0, 30, [("copy", 10, 2), ("K1", 13, 40)]))
    got = trace_table.diff(fast, fewer).splitlines()[1]
    check(got == "first difference at operation #2: K2 grid [1, 1, 1] block [128, 1, 1] against none", got)
    two = trace(call("fast", 0, 30, [("K1", 10, 2)]) + call("slow", 100, 30, [("K1", 110, 2)]))
    try:
        trace_table.diff(fast, two)
        check(False, "--diff of a trace with two configurations should fail")
    except ValueError as e:
        check("2 configurations with device operations (fast, slow); --diff takes traces of one each" in str(e),
              str(e))
    out = subprocess.run([sys.executable, os.path.join(E2E, "trace_table.py"), "--diff", fast, slow],
                         capture_output=True, text=True, timeout=60)
    check(out.returncode == 0 and out.stdout.startswith("diff of slow (115.0 us a call) against fast"),
          f"{out.stdout}{out.stderr}")


def without_trace(out):
    """run.py's table names why a configuration has no profile: its run or its profiler failed, or its trace is
    missing; in the results table's order."""
    import run
    os.makedirs(out, exist_ok=True)
    missing = os.path.join(out, "never-written.json")
    summaries = {("cpp", "perf"): run.profile_summary(missing, 2, "the profiler failed: CUPTI unavailable"),
                 ("python", "eager_fp32"): run.profile_summary(missing, 2)}
    run.write_profile("cnn", summaries, out)
    with open(os.path.join(out, "profile-cnn.md")) as f:
        table = f.read()
    python, cpp = (table.find(f"| {label} | no profile: ") for label in ("Python eager fp32", "C++ perf recipe"))
    check(0 <= python < cpp, f"both rows, Python eager fp32 first (LABELS' order):\n{table}")
    check("| C++ perf recipe | no profile: the profiler failed: CUPTI unavailable |" in table, table)
    check("| Python eager fp32 | no profile: FileNotFoundError: " in table and "never-written.json" in table, table)


def failed_run(e2e, out):
    """A C++ run that fails: the runner ends with its error (e2e's main), run.py reports it with the backtrace frames
    of LibTorch's error left out, keeps the whole stderr in <out>, says why the row has no profile, and exits 1."""
    os.makedirs(out, exist_ok=True)
    broken = os.path.join(out, "e2e-without-data")
    calls = os.path.join(out, "calls.txt")
    with open(broken, "w") as f:  # the real runner, its --data pointing nowhere (`--info` works: run.py asks it)
        f.write(f'#!/usr/bin/env bash\necho "$*" >>{calls}\nargs=()\nwhile (($#)); do\n  if [ "$1" = --data ]; '
                'then args+=(--data /nonexistent/e2e-data.pt); shift 2; else args+=("$1"); shift; fi\ndone\n'
                f'exec {e2e} "${{args[@]}}"\n')
    os.chmod(broken, 0o755)
    if os.path.exists(calls):
        os.remove(calls)
    cmd = [sys.executable, os.path.join(E2E, "run.py"), "--e2e", broken, "--check", "--jobs", "mlp", "--configs",
           "stock", "--profile-steps", "2", "--out", out, "--cpp-cudnn-benchmark", "off", "--cpp-check-syncs", "off"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    with open(calls) as f:  # the diagnosis flags reach the runner: stock LibTorch has no perf::setup() to change
        stock = [line for line in f if "--config stock" in line]
    check(len(stock) == 1 and "--check-syncs false" in stock[0] and "--cudnn-benchmark" not in stock[0],
          f"the runner's arguments: {stock}")
    check(proc.returncode == 1, f"run.py exit {proc.returncode} (want 1):\n{proc.stderr[-3000:]}")
    kept = os.path.join(out, "failed-cpp-mlp-stock.log")
    check(f"FAILED cpp mlp stock (rc 1); its stderr without backtrace frames (all of it: {kept}):" in proc.stderr,
          proc.stderr[-3000:])
    check("e2e failed: perf::load: '/nonexistent/e2e-data.pt' is not a file" in proc.stderr, proc.stderr[-3000:])
    check("frame #" not in proc.stderr and "backtrace frame lines left out)" in proc.stderr, proc.stderr[-3000:])
    with open(kept) as f:
        whole = f.read()
    check("frame #0: " in whole and whole.rstrip().endswith("e2e failed: perf::load: '/nonexistent/e2e-data.pt' is not a file"),
          f"the kept stderr, LibTorch's backtrace included, the message last:\n{whole[-2000:]}")
    check("profile mlp C++ stock LibTorch fp32: no profile (the run failed (rc 1))" in proc.stderr, proc.stderr[-3000:])
    with open(os.path.join(out, "results.jsonl")) as f:  # the failure, as a row that report.py shows
        rows = [json.loads(line) for line in f]
    check(len(rows) == 1 and rows[0]["config"] == "stock" and rows[0]["job"] == "mlp"
          and rows[0]["failed"] == "rc 1: e2e failed: perf::load: '/nonexistent/e2e-data.pt' is not a file"
          and "samples_per_s" not in rows[0], f"results.jsonl: {rows}")
    proc = subprocess.run([sys.executable, os.path.join(E2E, "report.py"), os.path.join(out, "results.jsonl"),
                           "--docs", out, "--name", "report-failed"], capture_output=True, text=True, timeout=120)
    with open(os.path.join(out, "report-failed.md")) as f:
        table = f.read()
    check(proc.returncode == 0 and "Every run of this job failed:" in table and "- C++ stock LibTorch fp32: rc 1: "
          "e2e failed: perf::load: '/nonexistent/e2e-data.pt' is not a file" in table and "| configuration |" not in table,
          f"exit {proc.returncode} {proc.stderr[-2000:]}\n{table}")


def diagnosed_run(e2e, out):
    """run.py --diagnose: a C++ perf run that fails runs again with cuDNN's benchmark mode off. Here a runner that
    fails unless told `--cudnn-benchmark false` (the real one then); both attempts are rows, the second named by
    the setting it turned off, and report.py lists the failure beside the row that trained."""
    os.makedirs(out, exist_ok=True)
    picky = os.path.join(out, "e2e-benchmark-fails")
    with open(picky, "w") as f:
        f.write(f'#!/usr/bin/env bash\ncase " $* " in\n  *" --info "*|*" --cudnn-benchmark false "*) exec {e2e} "$@" ;;\n'
                'esac\necho "e2e failed: the convolution failed with cuDNN benchmark on" >&2\nexit 1\n')
    os.chmod(picky, 0o755)
    cmd = [sys.executable, os.path.join(E2E, "run.py"), "--e2e", picky, "--quick", "--jobs", "mlp", "--configs", "perf",
           "--diagnose", "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    check(proc.returncode == 1 and "--diagnose: cpp mlp perf again with cuDNN benchmark off" in proc.stdout
          and "FAILED cpp mlp perf (rc 1)" in proc.stderr and "cpp mlp perf: " in proc.stdout
          and "(cuDNN benchmark off)   [" in proc.stdout, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "results.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    check(len(rows) == 2 and rows[0]["failed"] == "rc 1: e2e failed: the convolution failed with cuDNN benchmark on"
          and "diagnosis" not in rows[0] and rows[1]["diagnosis"] == "cuDNN benchmark off"
          and rows[1]["samples_per_s"] > 0 and rows[1]["config"] == "perf", f"results.jsonl: {rows}")
    proc = subprocess.run([sys.executable, os.path.join(E2E, "report.py"), os.path.join(out, "results.jsonl"),
                           "--docs", out, "--name", "report-diagnosed"], capture_output=True, text=True, timeout=120)
    with open(os.path.join(out, "report-diagnosed.md")) as f:
        table = f.read()
    check(proc.returncode == 0 and "| C++ perf recipe | failed (below) | | | | |" in table
          and "| C++ perf recipe (cuDNN benchmark off) | " in table and "No Python eager fp32 row in this run "
          "(run.py --configs): ratios are to C++ perf recipe (cuDNN benchmark off)." in table
          and "Failed: C++ perf recipe: rc 1: e2e failed: the convolution failed with cuDNN benchmark on." in table,
          f"exit {proc.returncode} {proc.stderr[-2000:]}\n{table}")


def real_run(e2e, out):
    cmd = [sys.executable, os.path.join(E2E, "run.py"), "--e2e", e2e, "--check", "--jobs", "mlp", "--profile-steps",
           "2", "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(proc.stdout)
    check(proc.returncode == 0, f"run.py exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "profile-mlp.md")) as f:
        table = f.read()
    print(table)
    for label in ("Python eager fp32", "C++ stock LibTorch fp32"):
        row = next((l for l in table.splitlines() if l.startswith(f"| {label} |")), None)
        check(row is not None, f"an overview row for {label}")
        wall, busy, ops = (float(v) for v in row.split("|")[2:5])
        check(wall > 0 and 0 < busy <= wall * 1.01 and ops >= 10, f"{label}: wall {wall}, self {busy}, ops {ops}")
        section = table.split(f"### {label}: top operators (self time)")[1].split("###")[0]
        check("`aten::addmm`" in section, f"{label}'s MLP runs its linear layers as aten::addmm:\n{section}")
        check(f"profile mlp {label}: " in proc.stdout, f"a line for {label} in run.py's output")


def report_tables(out):
    """report.py on the real run's rows: ratios to Python eager fp32; and on the same rows without it (run.py
    --configs, as a GPU call that runs two rows writes them): ratios to the job's first row, saying so."""
    with open(os.path.join(out, "results.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    check(sorted(r["config"] for r in rows) == ["eager_fp32", "stock"], f"the real run's rows: {rows}")
    subset = os.path.join(out, "without-eager.jsonl")
    with open(subset, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows if r["config"] != "eager_fp32")
    for results, name in ((os.path.join(out, "results.jsonl"), "all"), (subset, "subset")):
        proc = subprocess.run([sys.executable, os.path.join(E2E, "report.py"), results, "--docs", out, "--name",
                               f"report-{name}"], capture_output=True, text=True, timeout=120)
        check(proc.returncode == 0, f"report.py on the {name} rows: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "report-all.md")) as f:
        table = f.read()
    check("| configuration | samples/s | vs Python eager fp32 |" in table and "| Python eager fp32 | " in table
          and "No Python eager fp32 row" not in table and "C++ stock run the same fp32 job" in table, table)
    with open(os.path.join(out, "report-subset.md")) as f:
        table = f.read()
    row = next((l for l in table.splitlines() if l.startswith("| C++ stock LibTorch fp32 |")), "")
    check("No Python eager fp32 row in this run (run.py --configs): ratios are to C++ stock LibTorch fp32." in table
          and "| configuration | samples/s | vs C++ stock LibTorch fp32 |" in table
          and row.split("|")[3].strip() == "1.00x" and "| Python eager fp32 |" not in table, table)
    # The real run's Python row beside failed_run's failed C++ row: the table lists the failure and says why.
    with open(os.path.join(out, "failed-run", "results.jsonl")) as f:
        failed = [json.loads(line) for line in f]
    mixed = os.path.join(out, "with-failure.jsonl")
    with open(mixed, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in [r for r in rows if r["config"] == "eager_fp32"] + failed)
    proc = subprocess.run([sys.executable, os.path.join(E2E, "report.py"), mixed, "--docs", out, "--name",
                           "report-with-failure"], capture_output=True, text=True, timeout=120)
    with open(os.path.join(out, "report-with-failure.md")) as f:
        table = f.read()
    check(proc.returncode == 0 and "| Python eager fp32 | " in table
          and "| C++ stock LibTorch fp32 | failed (below) | | | | |" in table
          and "Failed: C++ stock LibTorch fp32: rc 1: e2e failed: perf::load: '/nonexistent/e2e-data.pt' is not a file." in table
          and "C++ stock run the same fp32 job" not in table, f"exit {proc.returncode} {proc.stderr[-2000:]}\n{table}")


def kept_runs(out):
    """report.py --keep writes the run it reports, each row stamped with its run (machine, commit, date, command);
    given kept runs and a new one, each job's section comes from the last file that has the job and names its run;
    runs on two devices are refused, with nothing written."""
    report = os.path.join(E2E, "report.py")
    kept_dir, docs = os.path.join(out, "kept"), os.path.join(out, "kept-docs")
    for d in (kept_dir, docs):
        if os.path.isdir(d):
            for f in os.listdir(d):
                os.remove(os.path.join(d, f))

    def run(*args):
        proc = subprocess.run([sys.executable, report, *args, "--docs", docs], capture_output=True, text=True,
                              timeout=120)
        return proc.returncode, proc.stdout + proc.stderr

    rc, log = run(os.path.join(out, "results.jsonl"), "--name", "new", "--keep", kept_dir, "--machine", "the VM",
                  "--command", "run.py --check --jobs mlp")
    check(rc == 0, f"report.py --keep: exit {rc}\n{log[-3000:]}")
    kept = sorted(os.listdir(kept_dir))
    check(len(kept) == 1 and kept[0].startswith("new-") and f"kept the run in {os.path.join(kept_dir, kept[0])}" in log,
          f"one kept file, named by --name, and said: {kept}\n{log}")
    with open(os.path.join(kept_dir, kept[0])) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out, "results.jsonl")) as f:
        fresh = [json.loads(line) for line in f]
    stamp = rows[0]["run"]
    check([{k: v for k, v in r.items() if k != "run"} for r in rows] == fresh and all(r["run"] == stamp for r in rows)
          and stamp["machine"] == "the VM" and stamp["command"] == "run.py --check --jobs mlp"
          and kept[0].endswith(f"-{stamp['commit']}.jsonl") and len(stamp["date"]) == 10,
          f"the kept rows are the run's, each with its run: {rows[0]['run']} in {kept[0]}")
    with open(os.path.join(docs, "new.md")) as f:
        table = f.read()
    check(f"Machine: the VM; torch {stamp['torch']}; commit `{stamp['commit']}`." in table
          and "This run: " in table and "`run.py --check --jobs mlp`" in table and "Run: " not in table, table)

    # An earlier run of another job (the CNN) and of the same job at another speed, kept by a GPU call.
    earlier_run = {"machine": "Earlier GPU", "commit": "abc1234", "date": "2026-01-02", "torch": stamp["torch"],
                   "command": "gpu-check.sh --part e2e --jobs cnn,mlp"}
    earlier = os.path.join(kept_dir, "new-20260102-0304-abc1234.jsonl")
    with open(earlier, "w") as f:
        for r in fresh:
            f.write(json.dumps(dict(r, job="cnn", run=earlier_run)) + "\n")
            f.write(json.dumps(dict(r, samples_per_s=r["samples_per_s"] * 10, run=earlier_run)) + "\n")
    rc, log = run(earlier, os.path.join(out, "results.jsonl"), "--name", "merged", "--machine", "the VM")
    check(rc == 0, f"report.py on a kept run and a new one: exit {rc}\n{log[-3000:]}")
    with open(os.path.join(docs, "merged.md")) as f:
        table = f.read()
    sections = table.split("\n## ")
    cnn = next((s for s in sections if s.startswith("cnn ")), "")
    mlp = next((s for s in sections if s.startswith("mlp ")), "")
    eager = next((r["samples_per_s"] for r in fresh if r["config"] == "eager_fp32"), 0)
    check("Each job's section comes from its own run" in table and "Machine: " not in table
          and "Run: Earlier GPU; torch" in cnn and "commit `abc1234`; 2026-01-02;" in cnn
          and "`gpu-check.sh --part e2e --jobs cnn,mlp`" in cnn
          and "Run: the VM;" in mlp and f"| Python eager fp32 | {eager:.1f} | 1.00x |" in mlp, table)
    # The same files the other way round: the earlier run is the last to have the MLP.
    rc, log = run(os.path.join(out, "results.jsonl"), earlier, "--name", "swapped")
    with open(os.path.join(docs, "swapped.md")) as f:
        table = f.read()
    check(rc == 0 and f"| Python eager fp32 | {eager * 10:.1f} | 1.00x |" in table and "Run: the VM" not in table
          and table.index("## mlp") < table.index("## cnn"), f"exit {rc}, {log[-2000:]}\n{table}")
    cuda_run = os.path.join(kept_dir, "cuda-run.jsonl")
    with open(cuda_run, "w") as f:
        f.writelines(json.dumps(dict(r, job="transformer", device="cuda", run=earlier_run)) + "\n" for r in fresh)
    rc, log = run(os.path.join(out, "results.jsonl"), cuda_run, "--name", "mixed")
    check(rc != 0 and "the runs given are on cpu and cuda; one document is one device" in log
          and not os.path.exists(os.path.join(docs, "mixed.md")), f"exit {rc}: {log[-2000:]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--e2e", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--part", choices=("failures", "run", "tables"),
                   help="failures: the traces' arithmetic and the failed runs; run: the real run; tables: report.py "
                        "on both parts' rows (run them first, with the same --out); default: all three")
    a = p.parse_args()
    if a.part in (None, "failures"):
        hand_made()
        without_trace(os.path.join(a.out, "without-trace"))
        failed_run(a.e2e, os.path.join(a.out, "failed-run"))
        diagnosed_run(a.e2e, os.path.join(a.out, "diagnosed-run"))
    if a.part in (None, "run"):
        real_run(a.e2e, a.out)
    if a.part in (None, "tables"):
        for part, path in (("failures", os.path.join(a.out, "failed-run", "results.jsonl")),
                           ("run", os.path.join(a.out, "results.jsonl"))):
            check(os.path.exists(path), f"--part {part} wrote {path} first")
        report_tables(a.out)
        kept_runs(a.out)
    print(f"e2e profile {a.part or 'tables, all parts'}: ok")


if __name__ == "__main__":
    main()
