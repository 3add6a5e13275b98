"""Shared by the checks of the benchmark reports (tests/report_*_check.py): a failed condition ends the check with
its message; a report run on results files; JSON-lines files read and written."""
import glob
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def run_report(script, docs, *args):
    """bench/<script> with `args` and --docs `docs`, from the repository's root: (exit status, its output)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args, "--docs", docs],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


def report_markdown(script, out, name, *paths):
    """bench/<script> on the results files `paths`, written as <out>/<name>.md: the markdown; the check ends with the
    report's output where it fails."""
    rc, log = run_report(script, out, *paths, "--name", name)
    check(rc == 0, f"{script} on {', '.join(paths)}: exit {rc}\n{log[-3000:]}")
    return read(os.path.join(out, f"{name}.md"))


def report_rows(script, out, name, rows):
    """report_markdown() on `rows`, written first as <out>/<name>.jsonl."""
    path = os.path.join(out, f"{name}.jsonl")
    write(path, rows)
    return report_markdown(script, out, name, path)


def kept_report(script, out, pattern, name):
    """bench/<script> on the latest run kept in docs/runs/<pattern>, written as <out>/<name>.md: (the kept file, its
    rows, the markdown)."""
    kept = sorted(glob.glob(os.path.join(ROOT, "docs", "runs", pattern)))
    check(kept, f"a kept run docs/runs/{pattern}")
    return kept[-1], rows_of(kept[-1]), report_markdown(script, out, name, kept[-1])


def read(path):
    with open(path) as f:
        return f.read()


def rows_of(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
