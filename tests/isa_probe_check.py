"""tools/export_compiled.py's remember_vec_isa_checks: Inductor's check of each vector instruction set answers from
the marker a passed check left, in a later process, with the same answer; a failed check leaves no marker and runs
again. Run by ctest (isa_probe_memory):

    python tests/isa_probe_check.py --out DIR

Each case is a new Python (Inductor keeps the answer per process) on one Inductor cache folder, DIR/inductor. It
counts the probe loads Inductor starts (a Python that imports torch and loads the probe's library) by wrapping
subprocess.check_call, and answers them without starting that Python, as failed or as passed: three Pythons in
all, so that a machine whose torch imports slowly (each load is one more import) does not make this test slow.
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
        if sys.argv[2] == "fail":
            raise subprocess.CalledProcessError(1, cmd)
        return 0
    return real(cmd, *args, **kwargs)

subprocess.check_call = counted
export_compiled.remember_vec_isa_checks()
export_compiled.remember_vec_isa_checks()  # twice, as two exports in one process do
isas = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
print(json.dumps({"loads": loads, "isas": isas}))
"""


def case(cache: str, probe: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)  # it would skip the checks this is about
    proc = subprocess.run([sys.executable, "-c", CASE, TOOLS, probe], capture_output=True, text=True,
                          timeout=300, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"FAILED: the case with {probe}ed loads exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
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

    failed = case(cache, "fail")
    if failed["loads"] == 0:
        print(f"skipped: Inductor checks no vector instruction set on this CPU ({failed['isas']})")
        return
    check(failed["isas"] == [], f"failed loads make every check fail: {failed}")
    check(not markers(cache), f"a failed check leaves no marker: {markers(cache)}")

    first = case(cache, "pass")
    check(first["loads"] >= failed["loads"] and first["isas"],
          f"with no marker, every check loads its probe again and passes: {first}")
    check(len(markers(cache)) == first["loads"], f"one marker per passed check ({first['loads']}): {markers(cache)}")

    later = case(cache, "pass")  # a load it started would be counted, not run
    check(later == {"loads": 0, "isas": first["isas"]},
          f"a later process answers from the markers, with no load and the same answer: {later} vs {first}")
    print(f"ok: {first['loads']} checks ({', '.join(first['isas'])}) answered from markers in a later process")

if __name__ == "__main__":
    main()
