"""bench/report_compiled.py on the H100 run kept in docs/runs (its tables, ratios, perf::optimize's decisions and the
lines against the compiled-inference goals, from the rows), and its kept runs (bench/runs.py): --keep writes the run
it reports with its run stamp; given a kept run and a new one, each batch size's section comes from the last file
that has it and names its run; runs on two devices are refused, with nothing written; a run without the C++ eager
fp32 row says what its ratios are to. Run by ctest (report_compiled_tables):

    python tests/report_compiled_check.py --out DIR
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys

from report_check_util import ROOT, check, read, report_rows, rows_of, run_report, write


def report(docs, *args):
    return run_report("report_compiled.py", docs, *args)


def section(table, batch):
    return next((s for s in table.split("\n## ") if s.startswith(f"batch {batch}\n")), "")


def kept_h100(out):
    """The kept H100 run: every row in its batch's table with its ratio to C++ eager fp32 and to the best Python
    torch.compile mode, computed here from the rows; the decisions; the run named in the header."""
    kept = sorted(glob.glob(os.path.join(ROOT, "docs", "runs", "compiled-cuda-*.jsonl")))
    check(kept, "a kept compiled-cuda run in docs/runs")
    rc, log = report(out, *kept, "--name", "h100")
    check(rc == 0, f"report_compiled.py on {kept}: exit {rc}\n{log[-3000:]}")
    table = read(os.path.join(out, "h100.md"))
    rows = rows_of(kept[-1])
    run = rows[0]["run"]
    check(f"Machine: {run['machine']}; torch {run['torch']}; commit `{run['commit']}`." in table
          and f"This run: {run['date']}, `{run['command']}`." in table and "Run: " not in table, table[:1500])
    for batch in sorted({r["batch"] for r in rows}):
        rs = [r for r in rows if r["batch"] == batch]
        text = section(table, batch)
        base = next(r["median_ms"] for r in rs if r["config"] == "C++ eager fp32")
        best = min(r["median_ms"] for r in rs if r["config"].startswith("Python torch.compile"))
        for r in rs:
            line = f"| {r['config']} | {r['median_ms']:.3f} | {base / r['median_ms']:.2f}x | " \
                   f"{best / r['median_ms']:.2f}x |"
            check(line in text, f"batch {batch}: {line}\n{text}")
        lines = text.split("\n")
        order = [next(i for i, t in enumerate(lines) if t.startswith(f"| {r['config']} |"))
                 for r in sorted(rs, key=lambda r: -r["median_ms"])]
        check(order == sorted(order), f"batch {batch}: slowest first\n{text}")
        for r in (r for r in rs if "decision_s" in r):
            said = (f"- {r['config']}: {r['recipe']}, decided in {r['decision_s']:.2f} s (first calls "
                    f"{r['first_calls_s']:.2f} s, CUDA graph captures {r['captures_s']:.2f} s)")
            check(said in text, f"batch {batch}: {said}\n{text}")
    check(table.count("decided in") == sum("decision_s" in r for r in rows), table)
    return kept[-1], rows


def judged(ratio, goal, what):
    return f"{ratio:.2f}x {what} (goal >= {goal}x: {'met' if ratio >= goal else 'not met'})"


def goal_lines(out, h100_rows):
    """Each batch's lines against the compiled-inference goals, computed here from the rows: perf::graph of the
    fastest package against Python's max-autotune (where the run has that row) and, at batch 1, eager fp32;
    perf::optimize against eager fp32 and the best fixed recipe; on the CPU the fastest package against eager."""
    fresh = [{k: v for k, v in r.items() if k != "run"} for r in h100_rows]
    ms = {(r["batch"], r["config"]): r["median_ms"] for r in fresh}
    # A max-autotune row at batch 1 that perf's graphed package beats, and at batch 32 one that beats it.
    graphed = {b: min((r for r in fresh if r["batch"] == b and r["config"].startswith("C++ perf::graph(package")),
                      key=lambda r: r["median_ms"]) for b in (1, 32)}
    autotune = {1: graphed[1]["median_ms"] * 1.25, 32: graphed[32]["median_ms"] * 0.8}
    rows = fresh + [{"lang": "python", "config": "Python torch.compile max-autotune", "device": "cuda", "batch": b,
                     "median_ms": autotune[b]} for b in (1, 32)]
    table = report_rows("report_compiled.py", out, "goals", rows)
    for b in (1, 32):
        text, g, eager = section(table, b), graphed[b], ms[(b, "C++ eager fp32")]
        want = f"- {g['config']} ({g['median_ms']:.3f} ms): " + judged(
            autotune[b] / g["median_ms"], 1.0, "Python torch.compile max-autotune")
        if b == 1:
            want += "; " + judged(eager / g["median_ms"], 3.0, "C++ eager fp32")
        check(want + "\n" in text, f"batch {b}: {want}\n{text}")
        tuned = ms[(b, "C++ perf::optimize(example)")]
        fixed_name, fixed = min(((c, v) for (bb, c), v in ms.items() if bb == b and (
            c in ("C++ eager fp32", "C++ eager + perf recipe") or c.startswith("C++ perf::graph(eager recipe)"))),
            key=lambda cv: cv[1])
        want = (f"- C++ perf::optimize(example) ({tuned:.3f} ms): {judged(eager / tuned, 0.97, 'C++ eager fp32')}; "
                + judged(fixed / tuned, 0.97, f"the best fixed recipe, {fixed_name} ({fixed:.3f} ms), level within 3%"))
        check(want + "\n" in text, f"batch {b}: {want}\n{text}")
    check("(goal >= 1.0x: met)" in section(table, 1) and "(goal >= 1.0x: not met)" in section(table, 32), table)
    # The same rows as a CPU run: the fastest package against eager fp32, perf::graph not judged.
    cpu = os.path.join(out, "goals-cpu.jsonl")
    write(cpu, [dict(r, device="cpu") for r in fresh if r["batch"] == 32])
    rc, log = report(out, cpu, "--name", "goals-cpu")
    text = section(read(os.path.join(out, "goals-cpu.md")), 32)
    package = min((r for r in fresh if r["batch"] == 32 and r["config"].startswith("C++ package")),
                  key=lambda r: r["median_ms"])
    want = (f"- {package['config']} ({package['median_ms']:.3f} ms): "
            + judged(ms[(32, "C++ eager fp32")] / package["median_ms"], 1.2, "C++ eager fp32"))
    check(rc == 0 and want + "\n" in text and "perf::graph(package" not in text.split("goals:")[-1],
          f"exit {rc}: {want}\n{text}")
    # Without a max-autotune row the line says why, from the run's command: gpu-check's --quick leaves the mode
    # out; a call without it whose peer has no such row was stopped by its budget.
    plain = [r for r in fresh if r["batch"] == 32 and r["config"] != "Python torch.compile max-autotune"]
    for command, why in (("bash scripts/gpu-check.sh --part bench --quick --bench compiled",
                          "(gpu-check's --quick leaves it out)"),
                         ("bash scripts/gpu-check.sh --part build,bench --bench compiled",
                          "(Python's peer ended before it: its autotuning takes minutes, and the call's budget stops "
                          "the peer)")):
        stamped = os.path.join(out, "goals-no-autotune.jsonl")
        write(stamped, [dict(r, run=dict(machine="the VM", commit="0000000", date="2026-11-29", torch="2.11.0",
                                          command=command)) if r["lang"] == "cpp" else r for r in plain])
        rc, log = report(out, stamped, "--name", "goals-no-autotune")
        text = section(read(os.path.join(out, "goals-no-autotune.md")), 32)
        check(rc == 0 and f"Python torch.compile max-autotune: no row in this run {why}\n" in text,
              f"exit {rc}, {command}: {why}\n{text}")
    # Without the main row nothing is judged, and the section says so.
    partial = os.path.join(out, "goals-partial.jsonl")
    write(partial, [r for r in fresh if r["config"] != "C++ eager fp32"])
    rc, log = report(out, partial, "--name", "goals-partial")
    check(rc == 0 and "- no C++ eager fp32 row: the goals" in read(os.path.join(out, "goals-partial.md")), log)


def kept_runs(out, h100_path, h100_rows):
    kept_dir = os.path.join(out, "kept")
    shutil.rmtree(kept_dir, ignore_errors=True)
    fresh = [{k: v for k, v in r.items() if k != "run"} for r in h100_rows]
    # --keep: the new run's rows, each with its run.
    new = os.path.join(out, "new.jsonl")
    write(new, fresh)
    rc, log = report(out, new, "--name", "compiled-new", "--keep", kept_dir, "--machine", "the VM", "--command",
                     "bash scripts/bench-compiled.sh --device cuda")
    check(rc == 0, f"report_compiled.py --keep: exit {rc}\n{log[-3000:]}")
    files = sorted(os.listdir(kept_dir))
    check(len(files) == 1 and files[0].startswith("compiled-new-")
          and f"kept the run in {os.path.join(kept_dir, files[0])}" in log, f"one kept file, said: {files}\n{log}")
    rows = rows_of(os.path.join(kept_dir, files[0]))
    stamp = rows[0]["run"]
    check([{k: v for k, v in r.items() if k != "run"} for r in rows] == fresh and all(r["run"] == stamp for r in rows)
          and stamp["machine"] == "the VM" and stamp["command"] == "bash scripts/bench-compiled.sh --device cuda"
          and stamp["torch"] == torch_version_imported()
          and files[0].endswith(f"-{stamp['commit']}.jsonl") and len(stamp["date"]) == 10,
          f"the kept rows are the run's, each with its run: {stamp} in {files[0]}")
    # A kept run and a new one that has batch 32 only, twice as fast: batch 1 from the kept run, 32 from the new.
    faster = os.path.join(out, "faster.jsonl")
    write(faster, [dict(r, median_ms=r["median_ms"] / 2) for r in fresh if r["batch"] == 32])
    rc, log = report(out, h100_path, faster, "--name", "merged", "--machine", "the VM")
    check(rc == 0, f"report_compiled.py on a kept run and a new one: exit {rc}\n{log[-3000:]}")
    table = read(os.path.join(out, "merged.md"))
    run = h100_rows[0]["run"]
    one, many = section(table, 1), section(table, 32)
    eager32 = next(r["median_ms"] for r in fresh if r["batch"] == 32 and r["config"] == "C++ eager fp32")
    check("Each batch size's section comes from its own run" in table and "Machine: " not in table
          and f"Run: {run['machine']}; torch {run['torch']}; commit `{run['commit']}`; {run['date']}; " in one
          and "Run: the VM;" in many and f"| C++ eager fp32 | {eager32 / 2:.3f} | 1.00x |" in many, table)
    # The other way round: the kept run is the last to have batch 32.
    rc, log = report(out, faster, h100_path, "--name", "swapped")
    table = read(os.path.join(out, "swapped.md"))
    check(rc == 0 and "Run: the VM" not in table and f"| C++ eager fp32 | {eager32:.3f} | 1.00x |" in table,
          f"exit {rc}, {log[-2000:]}\n{table}")
    # One document is one device.
    cpu = os.path.join(out, "cpu.jsonl")
    write(cpu, [dict(r, device="cpu") for r in fresh if r["batch"] == 1])
    rc, log = report(out, h100_path, cpu, "--name", "mixed")
    check(rc != 0 and "the runs given are on cpu and cuda; one document is one device" in log
          and not os.path.exists(os.path.join(out, "mixed.md")), f"exit {rc}: {log[-2000:]}")
    # Without the C++ eager fp32 row (a run of some configurations): ratios to the batch's first row, said.
    partial = os.path.join(out, "partial.jsonl")
    write(partial, [r for r in fresh if r["config"] != "C++ eager fp32"])
    rc, log = report(out, partial, "--name", "partial")
    table = read(os.path.join(out, "partial.md"))
    first = next(r for r in fresh if r["batch"] == 1 and r["config"] != "C++ eager fp32")
    check(rc == 0 and f"No C++ eager fp32 row in this run: ratios are to {first['config']}." in section(table, 1)
          and f"| {first['config']} | {first['median_ms']:.3f} | 1.00x |" in section(table, 1),
          f"exit {rc}, {log[-2000:]}\n{table}")


def torch_version_imported():
    """torch.__version__ as a Python importing torch says it (the kept run's stamp reads it without the import)."""
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True, timeout=120, check=True).stdout.strip()


def torch_version_fallback(out):
    """Where the installed torch has no version.py, runs.torch_version() imports torch for it: a stand-in package."""
    standin = os.path.join(out, "standin-torch")
    shutil.rmtree(standin, ignore_errors=True)
    os.makedirs(os.path.join(standin, "torch"))
    with open(os.path.join(standin, "torch", "__init__.py"), "w") as f:
        f.write("__version__ = '9.9.9+standin'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([standin, os.path.join(ROOT, "bench")]))
    got = subprocess.run([sys.executable, "-c", "import runs; print(runs.torch_version())"], capture_output=True,
                         text=True, timeout=120, env=env)
    check(got.returncode == 0 and got.stdout.strip() == "9.9.9+standin",
          f"runs.torch_version() without torch/version.py: exit {got.returncode}, {got.stdout + got.stderr}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path, rows = kept_h100(a.out)
    goal_lines(a.out, rows)
    kept_runs(a.out, path, rows)
    torch_version_fallback(a.out)
    print("report_compiled tables: ok")


if __name__ == "__main__":
    main()
