"""Python PyTorch against C++ with perf on the same training jobs, side by side in one run.

    python bench/e2e/run.py --e2e build/bench/e2e [--device cpu|cuda] [--quick] [--jobs cnn,transformer,mlp]
    python bench/e2e/run.py --e2e build/bench/e2e --check     # the twins agree (CI)
    python bench/e2e/run.py --e2e build/bench/e2e --export-only [--device cuda]   # the training packages only
    python bench/e2e/run.py --export-only --amp bf16 --device cuda    # the same before the C++ runner is built
    python bench/e2e/run.py --e2e build/bench/e2e --profile-steps 2 ...   # and where each step's time goes

For each job: one initial state dict and one synthetic data set, saved once and
loaded by both languages; then every configuration, alternating Python and C++
(each in its own process; on CUDA the compiled rows first, configs()), appending
to <out>/results.jsonl; then report.py
writes the table and charts. scripts/bench-e2e.sh is the one command. A run
that fails (or a training package that does not export) is reported and the
other runs go on; the exit status is then 1. With --profile-steps N every
configuration's first run traces N more steps after its timed ones, and
<out>/profile-<job>.md says where a step's time went in each (trace_table.py).
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(HERE, "..", "..", "tools")
sys.path.insert(0, HERE)
import models  # noqa: E402
import trace_table  # noqa: E402
from report import LABELS  # noqa: E402


# glibc malloc keeping freed blocks of up to 32 MiB and never trimming its heap: what perf::setup()'s
# cpu_malloc_cache does with mallopt(), for Python's recipe rows (the tuning guides' jemalloc/tcmalloc advice).
MALLOC_CACHE = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 62)}


def configs(device, quick, full):
    """(language, configuration) in the order they run. On CUDA the compiled-training goal's rows come first (the
    baseline, Python's compiled modes, C++'s compiled step), so that a GPU call's time budget that stops the run
    stops it in the eager rows; report.py orders the table by LABELS whatever the order of the runs."""
    if device.startswith("cuda"):
        order = [("python", "eager_fp32"), ("python", "compile_recipe"), ("cpp", "perf_compiled_graph"),
                 ("python", "compile_reduce_overhead"), ("cpp", "perf_compiled"), ("cpp", "stock"),
                 ("python", "eager_recipe"), ("cpp", "perf"), ("cpp", "perf_trainstep")]
    else:
        order = [("python", "eager_fp32"), ("cpp", "stock"), ("python", "eager_recipe"), ("cpp", "perf"),
                 ("python", "compile_recipe"), ("cpp", "perf_compiled")]
    if (device.startswith("cuda") and not quick) or full:
        order += [("python", "compile_max_autotune")]  # slow to compile (255 s for the CNN on an H100)
    return order


def without_frames(text):
    """A failed run's stderr with the backtrace lines of LibTorch's errors left out ("frame #12: ..."): they
    fill the end of it, and the messages before them (AOTInductor's "Exception in aoti_torch: <the cause>") are
    what says why."""
    lines = text.splitlines()
    kept = [l for l in lines if not re.match(r"\s*frame #\d+: ", l)]
    if len(kept) < len(lines):
        kept.append(f"({len(lines) - len(kept)} backtrace frame lines left out)")
    return "\n".join(kept)


BENCHMARK_OFF, SYNC_CHECKS_OFF = "cuDNN benchmark off", "sync checks off"  # run.py's diagnosis settings
GRAPH_CONFIGS = ("perf_compiled_graph", "perf_trainstep")  # the C++ rows whose step is a CUDA graph (check_syncs)


def off_label(off):
    return f" ({', '.join(off)})" if off else ""


def rows_in(results):
    if not os.path.exists(results):
        return 0
    with open(results) as f:
        return sum(1 for line in f if line.strip())


def mark_rows(results, after, off):
    """Names in the rows a run wrote (those after the first `after`) the settings the diagnosis turned off."""
    with open(results) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows[after:]:
        r["diagnosis"] = ", ".join(off)
    with open(results, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def failure(stderr):
    """Why a run failed, in a line for the report: AOTInductor's "Exception in aoti_torch: <cause>" (the package's
    code writes the cause to stderr, and perf's error then says so) and the runner's "e2e failed: <error>", else the
    last line of its stderr that is not a backtrace frame (a Python traceback's exception)."""
    lines = [l.strip() for l in without_frames(stderr).splitlines()
             if l.strip() and not l.strip().endswith("backtrace frame lines left out)")]
    said = [next((l for l in lines if "Exception in aoti_torch: " in l), None),
            next((l for l in reversed(lines) if l.startswith("e2e failed: ")), None)]
    said = [l[:400] for l in said if l] or [l[:400] for l in lines[-1:]]
    return " / ".join(said) or "no message (stderr empty)"


def training_package(job, size, device, amp, out, layout="channels-last", options=None, max_autotune=False):
    """The job's training step compiled by tools/export_compiled.py --train with the recipe the C++ perf
    configurations use (autocast as perf's default for the device, channels-last for the CNN unless layout
    is "contiguous": then Inductor picks the layouts inside the step), the Inductor options given
    (--compiled-inductor-config) and max-autotune (--compiled-max-autotune), cached under
    $PERF_CACHE_DIR/e2e-packages by everything that shapes it. Returns (path, seconds the export took)."""
    sys.path.insert(0, TOOLS)
    from export_compiled import export_train  # noqa: E402

    channels_last = job == "cnn" and layout == "channels-last"
    options = options or {}
    h = hashlib.sha256(json.dumps([job, size, device, amp, channels_last, torch.__version__,
                                   sorted((k, repr(v)) for k, v in options.items()), max_autotune]).encode())
    for f in (os.path.join(HERE, "models.py"), os.path.join(HERE, "..", "resnet.py"),
              os.path.join(TOOLS, "export_compiled.py")):
        h.update(open(f, "rb").read())
    cache = os.path.join(os.environ.get("PERF_CACHE_DIR", os.path.expanduser("~/.cache/perf")), "e2e-packages")
    cached = os.path.join(cache, f"{job}-{h.hexdigest()[:16]}.pt2")
    seconds_file, refused_file = cached + ".seconds", cached[:-4] + ".refused"
    if os.path.exists(refused_file):
        # The exporter's check refused this very step before (same sources, torch and options): a wrong program
        # stays wrong, and exporting it again costs minutes on a GPU.
        raise ValueError(f"{open(refused_file).read().strip()} (refused before; remove {refused_file} to try again)")
    if not os.path.exists(cached):
        os.makedirs(cache, exist_ok=True)
        torch.manual_seed(0)
        x, y = models.make_data(job, size, size["batch"])
        started = time.time()
        try:
            export_train(models.make(job, size), models.loss, (x, y), cached[:-4] + ".tmp.pt2", device=device,
                         amp=amp, channels_last=channels_last, inductor_configs=options, max_autotune=max_autotune)
        except ValueError as e:
            if "compiled training step is wrong" in str(e):
                with open(refused_file, "w") as f:
                    f.write(f"{e}\n")
            raise
        os.replace(cached[:-4] + ".tmp.pt2", cached)
        with open(seconds_file, "w") as f:
            f.write(f"{time.time() - started:.1f}\n")
        print(f"exported the {job} training step in {time.time() - started:.0f} s -> {cached}", flush=True)
    seconds = float(open(seconds_file).read()) if os.path.exists(seconds_file) else 0.0
    local = os.path.join(out, f"{job}_train.pt2")
    shutil.copy2(cached, local)
    return local, seconds


def job_package(job, size, a, amp, options):
    """The job's training package as the perf_compiled configurations run it (training_package with run.py's
    arguments `a`): (path, export seconds), or False where it could not be made (reported on stderr)."""
    layouts = [a.compiled_layout]
    if job == "cnn" and a.compiled_layout == "channels-last":
        # A channels-last package the exporter refuses as a wrong program (the CUDA bug of docs/compiled-training.md,
        # "Channels-last on CUDA"): the best C++ can run is the contiguous one, labelled so.
        layouts.append("contiguous")
    while layouts:
        layout = layouts.pop(0)
        try:
            return training_package(job, size, a.device, amp, a.out, layout, options, a.compiled_max_autotune)
        except Exception as e:  # noqa: BLE001  (reported; the job's other runs go on)
            wrong = isinstance(e, ValueError) and "compiled training step is wrong" in str(e)
            then = "; exporting it contiguous instead" if wrong and layouts else ""
            print(f"FAILED exporting the {job} training step ({layout}): {type(e).__name__}: {e}{then}",
                  file=sys.stderr, flush=True)
            if not then:
                return False
    return False


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--e2e", help="the C++ runner (build/bench/e2e); --export-only with --amp needs none")
    p.add_argument("--device", default="cpu")
    p.add_argument("--jobs", default="cnn,transformer,mlp")
    p.add_argument("--quick", action="store_true", help="fewer steps (CI-sized; about 10 minutes on 2 CPU cores)")
    p.add_argument("--full", action="store_true", help="also torch.compile max-autotune on the CPU (slow to compile)")
    p.add_argument("--check", action="store_true",
                   help="only Python eager fp32 and C++ stock for a few steps; fail unless their losses agree")
    p.add_argument("--compiled-layout", default="channels-last", choices=["channels-last", "contiguous"],
                   help="the CNN's training package: channels-last compiled in (perf's recipe, the default), or "
                        "contiguous parameters and inputs, Inductor choosing the layouts inside the step")
    p.add_argument("--compiled-inductor-config", action="append", default=[], metavar="KEY=VALUE",
                   help="an Inductor option for the training packages (export_compiled.py --inductor-config), e.g. "
                        "layout_optimization=False; repeat for several; the report names them in the row")
    p.add_argument("--compiled-max-autotune", action="store_true",
                   help="export the training packages with --max-autotune (slow to compile: the peer of Python's "
                        "max-autotune row)")
    p.add_argument("--export-only", action="store_true",
                   help="only export (or find cached) each job's training package, as the perf_compiled rows would: "
                        "a later run with the same arguments finds them in $PERF_CACHE_DIR/e2e-packages")
    p.add_argument("--amp", choices=["bf16", "off"],
                   help="with --export-only: the autocast the C++ runner uses on --device (what `e2e --info` "
                        "prints; asked of --e2e when left out), so that the packages export before it is built")
    p.add_argument("--out", default="bench-results/e2e")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--malloc-ab", action="store_true",
                   help="only C++ perf and perf_compiled, each with perf::setup()'s cpu_malloc_cache on and off, "
                        "alternating (--repeat rounds); writes <out>/malloc-ab.md")
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="trace N more steps of every configuration after its timed ones (not timed; the first run "
                        "of each) and write <out>/profile-<job>.md: wall and GPU-busy time per step, the top kernels "
                        "(operators on the CPU); the traces stay in <out>")
    p.add_argument("--configs", metavar="LIST",
                   help="only these configurations, comma-separated (eager_fp32, compile_recipe, perf_compiled_graph, "
                        "...; README \"End to end\"), in the usual order: a GPU call that looks at one row")
    p.add_argument("--cpp-cudnn-benchmark", choices=["on", "off"], default="on",
                   help="perf::setup()'s cudnn_benchmark in the C++ perf rows (off: a diagnosis, the Python rows "
                        "keep theirs)")
    p.add_argument("--cpp-check-syncs", choices=["on", "off"], default="on",
                   help="the C++ CUDA-graph rows' check_syncs: their last warm-up call under CUDA's sync-debug mode "
                        "\"error\" (off: a diagnosis)")
    p.add_argument("--diagnose", action="store_true",
                   help="a C++ perf run that fails runs again with cuDNN's benchmark mode off, then (its step a CUDA "
                        "graph) also without the sync checks, until one trains; each attempt is a row of the report, "
                        "named by what it turned off (one GPU call instead of one per --cpp-* setting)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every configuration this many times, in rounds (a machine whose speed varies "
                        "between runs); the report gives the median run and the range")
    a = p.parse_args()
    if a.amp and not a.export_only:
        p.error("--amp goes with --export-only (a run asks the C++ runner, --e2e, which autocast it uses)")
    if not a.e2e and not (a.export_only and a.amp):
        p.error("--e2e (the C++ runner, build/bench/e2e) is needed, except by --export-only with --amp")
    if a.repeat < 1:
        p.error(f"--repeat must be at least 1, got {a.repeat}")
    if a.profile_steps < 0:
        p.error(f"--profile-steps must be 0 (no profile) or more, got {a.profile_steps}")
    sys.path.insert(0, TOOLS)
    import export_compiled  # noqa: E402

    try:
        options = export_compiled.cli_inductor_options(a.compiled_inductor_config, "--compiled-inductor-config")
    except ValueError as e:
        p.error(str(e))

    dev_kind = "cuda" if a.device.startswith("cuda") else "cpu"
    os.makedirs(a.out, exist_ok=True)
    amp = a.amp or subprocess.run([a.e2e, "--info", "--device", a.device], capture_output=True, text=True,
                                  check=True).stdout.strip().split("amp=")[-1]
    if a.export_only:
        made = [job_package(job, models.JOBS[job][dev_kind], a, amp, options) for job in a.jobs.split(",")]
        for job, package in zip(a.jobs.split(","), made):
            print(f"{job}: " + (f"{package[0]} (exported in {package[1]:.0f} s)" if package else "FAILED"), flush=True)
        return 0 if all(made) else 1
    results = os.path.join(a.out, "results.jsonl")
    if os.path.exists(results):
        os.remove(results)
    if a.check:
        warmup, steps, window = 1, 4, 2
    elif a.quick:
        warmup, steps, window = 3, 15, 5
    else:
        warmup, steps, window = 5, 40, 5
    runs = [("python", "eager_fp32"), ("cpp", "stock")] if a.check else configs(a.device, a.quick, a.full)
    if a.configs:
        wanted = a.configs.split(",")
        known = [config for _, config in runs]
        unknown = [c for c in wanted if c not in known]
        if unknown:
            p.error(f"--configs: {', '.join(unknown)} is not a configuration of this run; valid: {', '.join(known)}")
        runs = [(lang, config) for lang, config in runs if config in wanted]
    runs = [(lang, config, None) for lang, config in runs]
    if a.malloc_ab:
        runs = [("cpp", config, cache) for config in ("perf", "perf_compiled") for cache in (False, True)]
    ab = {}  # (job, config, cache) -> samples/s of each run
    started = time.time()
    failed = []
    for job in a.jobs.split(","):
        size = models.JOBS[job][dev_kind]
        samples = size["batch"] * min(warmup + steps, 16)  # epochs repeat after 16 batches
        data_path = os.path.join(a.out, f"data_{job}.pt")
        init_path = os.path.join(a.out, f"init_{job}.pt")
        x, y = models.make_data(job, size, samples)
        torch.save({"x": x, "y": y}, data_path)
        torch.manual_seed(0)
        torch.save(dict(models.make(job, size).state_dict()), init_path)
        common = ["--job", job, "--device", a.device, "--data", data_path, "--init", init_path,
                  "--warmup", str(warmup), "--steps", str(steps), "--window", str(window), "--out", results]

        def record_failure(lang, config, why, off=()):
            """A run that failed, as a row of results.jsonl (report.py lists it and why, without figures)."""
            row = {"lang": lang, "job": job, "config": config, "device": a.device, "failed": why,
                   "batch": size["batch"], "warmup": warmup, "steps": steps}
            if off:
                row["diagnosis"] = ", ".join(off)
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
        package = None
        traces, summaries = {}, {}  # (lang, config) -> its first run's trace; that trace's summary (or why none)
        if os.path.exists(os.path.join(a.out, f"profile-{job}.md")):
            os.remove(os.path.join(a.out, f"profile-{job}.md"))  # an earlier run's: not this one's

        def profiled(lang, config, reason=None):
            """After a traced run: its summary (or `reason`, why it has none), and the job's table written again,
            so that a run the time budget stops leaves the table of those before it."""
            if (lang, config) not in traces or (lang, config) in summaries:
                return
            summaries[lang, config] = profile_summary(traces[lang, config], a.profile_steps, reason)
            label = LABELS.get((lang, config), f"{lang} {config}")
            if isinstance(summaries[lang, config], dict):
                print(f"profile {job} " + trace_table.line(label, summaries[lang, config]), flush=True)
            else:
                print(f"profile {job} {label}: no profile ({summaries[lang, config]})", file=sys.stderr, flush=True)
            write_profile(job, summaries, a.out)

        def attempt(lang, config, cache, cmd, env, off, log_suffix=""):
            """Runs one configuration's process; True if it trained. `off` names what the diagnosis flags turned
            off (run.py --cpp-cudnn-benchmark, --cpp-check-syncs, --diagnose): the rows it writes say so."""
            t0 = time.time()
            before = rows_in(results)
            # A run that fails is reported and the others go on (a crash in one configuration, say a CUDA
            # graph capture, must not hide the rest of a GPU session's table); the exit status says it.
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
            except subprocess.TimeoutExpired:
                print(f"FAILED {lang} {job} {config}{off_label(off)}: timed out after {a.timeout} s (--timeout)",
                      file=sys.stderr, flush=True)
                failed.append(f"{lang} {job} {config}{off_label(off)}")
                record_failure(lang, config, f"timed out after {a.timeout} s (--timeout)", off)
                profiled(lang, config, f"the run timed out after {a.timeout} s")
                return False
            said = proc.stdout.strip().splitlines()  # the run's result line: the last that names it
            line = next((l for l in reversed(said) if l.startswith(f"{lang} {job} {config}:")), said[-1] if said else "")
            timed = line.startswith(f"{lang} {job} {config}:")  # then results.jsonl has its row
            if off and timed:
                mark_rows(results, before, off)
            if proc.returncode != 0:
                kept = os.path.join(a.out, f"failed-{lang}-{job}-{config}{log_suffix}.log")
                with open(kept, "w") as f:
                    f.write(proc.stderr)
                print(f"FAILED {lang} {job} {config}{off_label(off)} (rc {proc.returncode})"
                      f"{' after its timed steps, whose result is kept: ' + line if timed else ''}; its stderr "
                      f"without backtrace frames (all of it: {kept}):\n{without_frames(proc.stderr)[-4000:]}",
                      file=sys.stderr, flush=True)
                failed.append(f"{lang} {job} {config}{off_label(off)}")
                if not timed:
                    record_failure(lang, config, f"rc {proc.returncode}: {failure(proc.stderr)}", off)
                profiled(lang, config, f"the run failed (rc {proc.returncode})")
                return timed
            print(f"{line}{off_label(off)}   [{time.time() - t0:.0f} s]", flush=True)
            no_profile = [l for l in proc.stderr.splitlines() if "no profile: " in l]
            profiled(lang, config, f"the profiler failed: {no_profile[-1].split('no profile: ', 1)[1]}" if no_profile
                     else None)
            if cache is not None:
                ab.setdefault((job, config, cache), []).append(float(line.split(": ")[1].split()[0]))
            return True

        for lang, config, cache in [run for _ in range(a.repeat) for run in runs]:
            off = []  # what the diagnosis flags turn off in this run (the report names it in the row)
            if lang == "python":
                cmd = [sys.executable, os.path.join(HERE, "train.py"), "--config", config, "--size", json.dumps(size),
                       "--amp", amp] + common
            else:
                cmd = [a.e2e, "--config", config, "--size", ",".join(f"{k}={v}" for k, v in size.items())] + common
                if config.startswith("perf_compiled"):
                    if package is None:
                        package = job_package(job, size, a, amp, options)
                    if package is False:
                        failed.append(f"{lang} {job} {config} (no package)")
                        record_failure(lang, config, "no package: its export failed (run.py's output says why)")
                        continue
                    cmd += ["--package", package[0], "--export-seconds", str(package[1])]
                if cache is not None:
                    cmd += ["--cpu-malloc-cache", "true" if cache else "false"]
                if a.cpp_cudnn_benchmark == "off" and config != "stock":
                    cmd += ["--cudnn-benchmark", "false"]
                    off.append(BENCHMARK_OFF)
                if a.cpp_check_syncs == "off":
                    cmd += ["--check-syncs", "false"]
                    if config in GRAPH_CONFIGS:
                        off.append(SYNC_CHECKS_OFF)
            first = cmd
            if a.profile_steps and (lang, config) not in traces:
                traces[lang, config] = os.path.join(a.out, f"trace-{job}-{lang}-{config}.json")
                if os.path.exists(traces[lang, config]):
                    os.remove(traces[lang, config])
                first = cmd + ["--profile-steps", str(a.profile_steps), "--profile", traces[lang, config]]
            env = None
            if lang == "python" and config != "eager_fp32":
                # The recipe's CPU allocator part, as perf::setup() applies it (cpu_malloc_cache): Python
                # can only have it from the environment, which glibc reads at start-up.
                env = dict(os.environ, **MALLOC_CACHE)
            if attempt(lang, config, cache, first, env, off) or not a.diagnose or lang != "cpp" or config == "stock":
                continue
            # --diagnose: the same run again with one more of perf's settings off, until one trains (not profiled).
            ladder = []
            if BENCHMARK_OFF not in off:
                ladder.append((["--cudnn-benchmark", "false"], BENCHMARK_OFF))
            if config in GRAPH_CONFIGS and SYNC_CHECKS_OFF not in off:
                ladder.append((["--check-syncs", "false"], SYNC_CHECKS_OFF))
            for k, (flags, what) in enumerate(ladder, 2):
                cmd, off = cmd + flags, off + [what]
                print(f"--diagnose: {lang} {job} {config} again with {', '.join(off)}", flush=True)
                if attempt(lang, config, cache, cmd, env, off, log_suffix=f"-{k}"):
                    break
    print(f"all runs: {time.time() - started:.0f} s")
    if failed:
        print(f"FAILED {len(failed)} of the runs: {', '.join(failed)}", file=sys.stderr)
        return 1
    if a.malloc_ab:
        return write_malloc_ab(ab, a, info)
    rows = [json.loads(l) for l in open(results)]
    if a.check:
        worst = 0.0
        for job in a.jobs.split(","):
            py = next((r for r in rows if r["job"] == job and r["lang"] == "python"), None)
            cpp = next((r for r in rows if r["job"] == job and r["lang"] == "cpp"), None)
            if py is None or cpp is None:
                print(f"{job}: --check compares Python eager fp32 with C++ stock; --configs {a.configs} left "
                      f"{'Python eager fp32' if py is None else 'C++ stock'} out", file=sys.stderr)
                return 1
            diff = max(abs(u - v) for u, v in zip(py["losses"], cpp["losses"]))
            print(f"{job}: Python eager fp32 vs C++ stock, {len(py['losses'])} steps, max |loss difference| {diff:.2e}")
            worst = max(worst, diff)
        if worst > 1e-3:
            print("the twins disagree: the jobs are not the same job", file=sys.stderr)
            return 1
        return 0
    return 0


def profile_summary(path, steps, reason=None):
    """trace_table's summary of one configuration's trace, or why it has none: `reason` (its run's or its
    profiler's failure), or why the trace could not be read."""
    if reason:
        return reason
    try:
        return trace_table.summarize(path, steps)
    except (OSError, ValueError, KeyError) as e:
        return f"{type(e).__name__}: {e}"


def write_profile(job, summaries, out):
    """<out>/profile-<job>.md from the summaries ((lang, config) -> summary, or why none), in the results table's
    order."""
    order = list(LABELS)
    keys = sorted(summaries, key=lambda k: order.index(k) if k in order else len(order))
    with open(os.path.join(out, f"profile-{job}.md"), "w") as f:
        f.write(trace_table.markdown(job, [(LABELS.get(k, " ".join(k)), summaries[k]) for k in keys]))


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def write_malloc_ab(ab, a, info):
    """The --malloc-ab table: median samples/s with perf::setup()'s cpu_malloc_cache off (glibc's defaults)
    and on, and their ratio, per job and C++ configuration."""
    import statistics

    lines = [f"# perf::setup()'s cpu_malloc_cache, A/B on bench/e2e ({a.device}, {a.repeat} rounds, alternating)",
             "", f"{cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}; C++ perf's {info.strip()}; "
             "median samples/s of the rounds.", "",
             "| job | configuration | cache off (glibc defaults) | cache on | on / off |", "| --- | --- | --- | --- | --- |"]
    for (job, config, cache), runs in ab.items():
        if cache or (job, config, True) not in ab:
            continue
        off, on = statistics.median(runs), statistics.median(ab[(job, config, True)])
        lines.append(f"| {job} | {config} | {off:.1f} | {on:.1f} | {on / off:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(a.out, "malloc-ab.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
