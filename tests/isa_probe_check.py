"""tools/export_compiled.py's remember_vec_isa_checks: Inductor's check of each vector instruction set answers from
the marker a passed check left, in a later process, with the same answer; a failed check leaves no marker and runs
again. Run by ctest (isa_probe_memory):

    python tests/isa_probe_check.py --out DIR

Each case is a new Python (Inductor keeps the answer per process) on one Inductor cache folder, DIR/inductor. It
counts the probe loads Inductor starts (a Python that imports torch and loads the probe's library) by wrapping
subprocess.check_call, and can answer them without starting that Python: as failed, or as passed (the answer the
first, real, case got; about a second less each on 2 cores).
"""
import argparse
import glob
import json
import os
import subprocess
import sys

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools")

CASE = r"""
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
import export_compiled
from torch._inductor import cpu_vec_isa

loads = 0
real = subprocess.check_call

def counted(cmd, *args, **kwargs):
    global loads
    if isinstance(cmd, list) and len(cmd) > 2 and cmd[1] == "-c" and "LoadLibrary" in cmd[2]:
        loads += 1
        if sys.argv[3] == "fail":
            raise subprocess.CalledProcessError(1, cmd)
        if sys.argv[3] == "pass":
            return 0
    return real(cmd, *args, **kwargs)

subprocess.check_call = counted
if sys.argv[2] == "remember":
    export_compiled.remember_vec_isa_checks()
    export_compiled.remember_vec_isa_checks()  # twice, as two exports in one process do
isas = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
print(json.dumps({"loads": loads, "isas": isas}))
"""


def case(cache: str, how: str, probe: str = "real") -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)  # it would skip the checks this is about
    proc = subprocess.run([sys.executable, "-c", CASE, TOOLS, how, probe], capture_output=True, text=True,
                          timeout=300, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"FAILED: the {how}/{probe} case exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def markers(cache: str) -> list:
    return glob.glob(os.path.join(cache, "**", "*.perf-load-ok"), recursive=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    cache = os.path.join(p.parse_args().out, "inductor")  # kept between runs: the probes compile once
    for marker in markers(cache):
        os.remove(marker)

    plain = case(cache, "plain")
    if plain["loads"] == 0:
        print(f"skipped: Inductor checks no vector instruction set on this CPU ({plain['isas']})")
        return
    check(not markers(cache), f"Inductor alone leaves no marker: {markers(cache)}")

    failed = case(cache, "remember", "fail")
    check(failed["loads"] > 0 and failed["isas"] == [], f"failed loads make every check fail: {failed}")
    check(not markers(cache), f"a failed check leaves no marker: {markers(cache)}")

    first = case(cache, "remember", "pass")
    check(first == plain, f"the first remembered checks load as Inductor alone does, same answer: {first} vs {plain}")
    check(len(markers(cache)) == plain["loads"], f"one marker per passed check ({plain['loads']}): {markers(cache)}")

    later = case(cache, "remember")
    check(later == {"loads": 0, "isas": plain["isas"]},
          f"a later process answers from the markers, with no load and the same answer: {later} vs {plain}")
    print(f"ok: {plain['loads']} checks ({', '.join(plain['isas'])}) answered from markers in a later process")


if __name__ == "__main__":
    main()
