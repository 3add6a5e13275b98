#!/usr/bin/env python3
"""tests/python_sampler (every Python's stack once a second) and tests/python_samples.py (their sums per test).

A test's process (a shell, as ctest would start it) runs a Python that waits 3 s for a subprocess, then computes for
3 s in busy_here(); the summary of that test must name both, with the sampler's own file matched to the test by its
parent's command line. A Python started without PERF_TEST_PYTHON_SAMPLES writes nothing.
"""
import json
import os
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what)
    if not ok:
        failures.append(what)


with tempfile.TemporaryDirectory() as tmp:
    child = os.path.join(tmp, "child.py")
    with open(child, "w") as f:
        f.write("import subprocess, time\n"
                "subprocess.run(['sleep', '3'])\n"
                "def busy_here():\n"
                "    start = time.monotonic()\n"
                "    while time.monotonic() - start < 3:\n"
                "        pass\n"
                "busy_here()\n")
    samples = os.path.join(tmp, "samples")
    command = ["/bin/sh", "-c", f"{sys.executable} {child}", "the-test"]
    env = dict(os.environ, PYTHONPATH=os.path.join(here, "python_sampler"), PERF_TEST_PYTHON_SAMPLES=samples)
    subprocess.run(command, env=env, check=True)
    off = dict(env)
    del off["PERF_TEST_PYTHON_SAMPLES"]
    subprocess.run([sys.executable, "-c", "print()"], env=off, check=True, stdout=subprocess.DEVNULL)
    files = os.listdir(samples)
    check(len(files) == 1, f"one sample file, from the sampled Python only: {files}")
    with open(os.path.join(samples, files[0]) if files else os.devnull, "a+") as f:
        f.seek(0)
        stacks = sum(1 for line in f if not line.startswith("# "))
        f.write("9.0\t\n")  # a sample after the main thread ended (shutdown): no frames, not counted

    tests = os.path.join(tmp, "tests.json")
    with open(tests, "w") as f:
        json.dump({"tests": [{"name": "the-test", "command": command},
                             {"name": "another", "command": ["/bin/sh", "-c", "true", "another"]}]}, f)
    kept = os.path.join(tmp, "kept")
    out = subprocess.run([sys.executable, os.path.join(here, "python_samples.py"), "--keep", kept, samples, tests,
                          "the-test",
                          "another", "missing"], check=True, capture_output=True, text=True).stdout.splitlines()
    print("\n".join(out))
    check(len(out) == 3, "a line per name")
    line = out[0] if out else ""
    check(line.startswith("the-test: 1 Python(s), "), "the test's one Python found by its parent's command line")
    try:
        count = int(line.split("Python(s), ")[1].split(" samples")[0])
    except (IndexError, ValueError):
        count = -1
    check(4 <= count <= 7 and count == stacks, f"about one sample a second over 6 s, each counted once: {count}")
    parts = {p.split("% ", 1)[1].split(" (")[0]: p for p in line.split("(s): ", 1)[-1].split("; ") if "% " in p}
    wait, busy = parts.get("waiting for a subprocess", ""), parts.get("running Python", "")
    check("<string>" not in line and "child.py:<module>" in wait, f"the wait is placed in the script: {wait}")
    check("child.py:busy_here" in busy, f"the computing is placed in busy_here: {busy}")
    # The count of the frame itself: a part may name more frames (a sample at the interpreter's shutdown lands in
    # threading.py, after busy_here's).
    for part, frame in ((wait, "child.py:<module> "), (busy, "child.py:busy_here ")):
        try:
            n = int(part.split(frame, 1)[1].split(",")[0].rstrip(")"))
        except (IndexError, ValueError):
            n = 0
        check(n >= 2, f"2 or more of the 3 s in {frame.strip()}: {part}")
    check(len(out) > 1 and out[1].startswith("another: 0 Python(s), no samples"), "a test without Pythons says so")
    check(len(out) > 2 and out[2] == "missing: not a test of this build", "an unknown name says so")
    check(sorted(os.listdir(kept)) == ["the-test"] and os.listdir(os.path.join(kept, "the-test")) == files,
          "--keep copies the summed files, in a folder per test")

sys.exit(1 if failures else 0)
