#!/usr/bin/env python3
"""Where the Pythons of the tests that ran long spent their time (tests/python_sampler/sitecustomize.py's samples).

    python tests/python_samples.py [--keep DIR] SAMPLES_DIR TESTS_JSON NAME...

TESTS_JSON is `ctest --show-only=json-v1`'s output: it gives each test's command, and a sample file belongs to a test
when its process or one of its parents runs that command. For each NAME, one line: how many Pythons, how many
samples (one a second, so about that many seconds of their time), and the shares of what the main thread was doing:
waiting for a subprocess (a compiler, say), importing modules, or running Python, each with the frames outside
Python's own library that it was doing it from most often. scripts/gpu-check.sh's tests part prints it for each test
over 60 s, and keeps (--keep) the sample files it summed, for a closer look.
"""
import collections
import json
import os
import re
import shutil
import sys


def short(frame):
    """path:line:function -> a short file:function (the line left out: one function is one place)."""
    path, _, function = frame.rsplit(":", 2)
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    else:
        path = "/".join(path.split("/")[-2:])
    return f"{path}:{function}"


def is_python_library(frame):
    path = frame.rsplit(":", 2)[0]
    return path.startswith("<frozen ") or (re.search(r"/lib/python3\.\d+/", path) and "site-packages" not in path)


def classify(frames):
    """(kind, place) of one sample: what the main thread did, and the innermost frame of ours or a package's."""
    place = next((short(f) for f in frames if not is_python_library(f)), short(frames[0]) if frames else "?")
    if any(f.rsplit(":", 2)[0].endswith("/subprocess.py") for f in frames):
        return "waiting for a subprocess", place
    if any(f.startswith("<frozen importlib") for f in frames):
        return "importing modules", place
    return "running Python", place


def read(path):
    """(parents' command lines, samples: a list of frames, innermost first, the file's path)."""
    commands, samples = [], []
    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("# "):
                commands.append(line.split(": ", 1)[1] if ": " in line else "")
            elif line:
                frames = [f for f in line.split("\t")[1:] if f.count(":") >= 2]
                if frames:  # none: the main thread had ended (the interpreter's shutdown)
                    samples.append(frames)
    return commands, samples, path


def summary(name, files):
    kinds, places, count = collections.Counter(), collections.defaultdict(collections.Counter), 0
    for _, samples, _ in files:
        for frames in samples:
            kind, place = classify(frames)
            kinds[kind] += 1
            places[kind][place] += 1
            count += 1
    if not count:
        return f"{name}: {len(files)} Python(s), no samples (each ran under a second, or the sampler was off)"
    parts = []
    for kind, n in kinds.most_common():
        top = ", ".join(f"{place} {m}" for place, m in places[kind].most_common(3))
        parts.append(f"{100 * n / count:.0f}% {kind} ({top})")
    return f"{name}: {len(files)} Python(s), {count} samples (s): " + "; ".join(parts)


def main(argv):
    keep = None
    if argv[:1] == ["--keep"] and len(argv) > 1:
        keep, argv = argv[1], argv[2:]
    if len(argv) < 3:
        sys.exit(__doc__)
    folder, tests_json, names = argv[0], argv[1], argv[2:]
    with open(tests_json) as f:
        tests = {t["name"]: " ".join(t.get("command", [])) for t in json.load(f).get("tests", [])}
    files = [read(os.path.join(folder, n)) for n in sorted(os.listdir(folder))] if os.path.isdir(folder) else []
    for name in names:
        command = tests.get(name)
        if not command:
            print(f"{name}: not a test of this build")
            continue
        mine = [f for f in files if any(c == command or c.startswith(command + " ") for c in f[0])]
        print(summary(name, mine))
        if keep and mine:
            os.makedirs(os.path.join(keep, name), exist_ok=True)
            for f in mine:
                shutil.copy(f[2], os.path.join(keep, name))


if __name__ == "__main__":
    main(sys.argv[1:])
