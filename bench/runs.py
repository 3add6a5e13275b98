"""Kept runs: a benchmark's results with the run that made them, so that a later report can draw on them.

A report (bench/e2e/report.py, bench/report_compiled.py, bench/report_optim.py; their charts: bench/charts.py)
given --keep DIR writes the rows of the run it reports into DIR/<name>-<UTC date and time>-<commit>.jsonl, each row
with a "run" entry: machine, commit ("-dirty" when the tree had changes), date, torch and the command that made it.
Given kept runs first and a new results file last, the report takes each section (a job, a batch size, a parameter
set) from the last file that has it."""
import argparse
import ast
import datetime
import importlib.util
import json
import os
import platform
import subprocess


def arguments(doc, results_help, name):
    """The options every report takes: its results files, --docs, --name (default `name`), --machine, --command
    and --keep. A report adds its own to the parser returned."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help=results_help)
    p.add_argument("--docs", default="docs")
    p.add_argument("--name", default=name)
    p.add_argument("--machine", default="", help="one line naming the machine")
    p.add_argument("--command", default="", help="the command that made the run being reported, for the record")
    p.add_argument("--keep", metavar="DIR", help="also write the run being reported into DIR (module doc)")
    return p


def gather(a, who, key):
    """The sections of a report called with arguments() `a`: its results files read (kept runs first), the run
    being reported kept where --keep asks (each file written said), each section (key(row)) from the last file
    that has it."""
    run, stamp = this_run(a.machine, a.command)
    runs = read_runs(a.results, run, who)
    if a.keep:
        for path in keep(runs, a.keep, a.name, run, stamp):
            print(f"kept the run in {path}")
    return latest_sections(runs, key)


def this_run(machine="", command=""):
    """The run being reported, made here and now: its "run" entry, and its UTC stamp for the kept file's name."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        if commit and subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                     text=True).stdout.strip():
            commit += "-dirty"  # the run's code is not the commit's alone
    except OSError:
        commit = ""
    now = datetime.datetime.now(datetime.timezone.utc)
    run = {"machine": machine or platform.processor() or platform.machine(), "commit": commit or "unknown",
           "date": now.strftime("%Y-%m-%d"), "torch": torch_version(), "command": command}
    return run, now.strftime("%Y%m%d-%H%M")


def torch_version():
    """torch.__version__ without importing torch: the `__version__ = '...'` line of the installed package's
    torch/version.py. A report needs nothing else of torch, and importing it took 2.3 of a report's 2.8 s (about 25
    reports run in the tests); scripts/bootstrap.sh asks it too. Imports torch only where that file or line is not
    there."""
    spec = importlib.util.find_spec("torch")  # finds the package without running it
    if spec and spec.origin:
        try:
            with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
                for line in f:
                    name, _, value = line.partition("=")
                    if name.strip() == "__version__":
                        return str(ast.literal_eval(value.strip()))
        except (OSError, ValueError, SyntaxError):
            pass
    import torch

    return torch.__version__


def read_runs(paths, run, who):
    """The rows of each results file (a list per file, in the order given), each row with its "run": a kept
    run's own, else `run` (the run being reported). A file without rows is an error: a kept run is never
    empty."""
    runs = []
    for path in paths:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if not rows:
            raise SystemExit(f"{who}: {path} has no rows")
        runs.append([dict(r, run=r.get("run") or run) for r in rows])
    return runs


def keep(runs, directory, name, run, stamp):
    """Writes the rows of the run being reported (rows whose "run" is `run`) into
    <directory>/<name>-<stamp>-<commit>.jsonl, `stamp` the UTC date and time (file names sort as the runs
    ran); returns the paths written."""
    written = []
    for rows in runs:
        fresh = [r for r in rows if r["run"] is run]
        if not fresh:
            continue
        os.makedirs(directory, exist_ok=True)
        stem = os.path.join(directory, f"{name}-{stamp}-{run['commit']}")
        target, n = stem + ".jsonl", 2
        while os.path.exists(target):
            target, n = f"{stem}-{n}.jsonl", n + 1
        with open(target, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in fresh)
        written.append(target)
    return written


def latest_sections(runs, key):
    """{section: its rows} with each section (key(row): a job, a batch size) from the last file that has it,
    in the order the sections first appear."""
    source = {}
    for rows in runs:
        for section in dict.fromkeys(key(r) for r in rows):
            source[section] = [r for r in rows if key(r) == section]
    order = dict.fromkeys(key(r) for rows in runs for r in rows)
    return {section: source[section] for section in order}


def distinct_runs(sections):
    """The runs that made the sections, each once, in the sections' order."""
    return list({json.dumps(rows[0]["run"], sort_keys=True): rows[0]["run"] for rows in sections.values()}.values())


def one_device(sections, who, documents):
    """The device every section ran on; more than one is an error (one document is one device)."""
    devices = sorted({r["device"] for rows in sections.values() for r in rows})
    if len(devices) > 1:
        raise SystemExit(f"{who}: the runs given are on {' and '.join(devices)}; one document is one device "
                         f"({documents}): report each device's runs on their own")
    return devices[0]


def about(sections, intro, section):
    """The paragraph under a report's title: with one run, the machine, torch and commit before `intro` and the
    command after it; with several, `intro` and that each `section` (a batch size, a parameter set) names its run.
    The torch version is a Python row's (the C++ rows have none) or else the run's."""
    distinct = distinct_runs(sections)
    if len(distinct) > 1:
        return (f"{intro} Each {section}'s section comes from its own run, named under its heading (the runs kept in "
                "docs/runs/).")
    one = distinct[0]
    torch_version = next((r["torch"] for rows in sections.values() for r in rows if "torch" in r), one["torch"])
    return (f"Machine: {one['machine']}; torch {torch_version}; commit `{one['commit']}`. {intro}"
            + (f" This run: {one['date']}, `{one['command']}`." if one.get("command") else ""))


def describe(run):
    return (f"{run['machine']}; torch {run['torch']}; commit `{run['commit']}`; {run['date']}"
            + (f"; `{run['command']}`" if run.get("command") else ""))
