"""bench/e2e/run.py --export-only --amp: the training packages export before the C++ runner is built (what
gpu-check's build part does beside the compilation), and a later run that asks the runner which autocast it uses
finds them in the cache instead of exporting again. Run by ctest (e2e_export_without_runner):

    python tests/e2e_export_check.py --e2e build/bench/e2e --out DIR
"""
import argparse
import os
import subprocess
import sys

RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "e2e", "run.py")


def run(*args):
    proc = subprocess.run([sys.executable, RUN, *args], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--e2e", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    info = subprocess.run([a.e2e, "--info", "--device", "cpu"], capture_output=True, text=True, check=True).stdout
    amp = info.strip().split("amp=")[-1]
    rc, out, err = run("--export-only", "--amp", amp, "--jobs", "mlp", "--out", os.path.join(a.out, "before"))
    check(rc == 0 and out.splitlines()[-1].startswith("mlp: "), f"export without the runner: exit {rc}\n{out}{err}")
    rc, out, err = run("--e2e", a.e2e, "--export-only", "--jobs", "mlp", "--out", os.path.join(a.out, "after"))
    check(rc == 0 and out.splitlines()[-1].startswith("mlp: "), f"export asking the runner: exit {rc}\n{out}{err}")
    check("exported the mlp training step" not in out,
          f"the runner's autocast ({amp}) finds the package exported with --amp {amp} in the cache:\n{out}")
    rc, _, err = run("--amp", amp, "--e2e", a.e2e)
    check(rc == 2 and "--amp goes with --export-only" in err, f"--amp without --export-only: exit {rc}\n{err}")
    rc, _, err = run("--export-only")
    check(rc == 2 and "--e2e (the C++ runner, build/bench/e2e) is needed" in err, f"no runner, no --amp: {rc}\n{err}")
    print("e2e export without the runner: ok")


if __name__ == "__main__":
    main()
