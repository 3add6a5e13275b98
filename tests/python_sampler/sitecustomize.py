"""Where a test's Python spends its time, without a profiler's overhead.

With this folder on PYTHONPATH and PERF_TEST_PYTHON_SAMPLES naming a folder, every Python that starts (a test's
reference Python, the exporter, a script's) writes <pid>.txt there: a header with its command line and its parents'
(so that a file can be matched to the ctest test that started it), then once a second the main thread's stack,
innermost frame first. tests/python_samples.py sums the files of the tests that ran long (scripts/gpu-check.sh's
tests part). Nothing happens without the variable.
"""
import os

if os.environ.get("PERF_TEST_PYTHON_SAMPLES"):
    import sys
    import threading
    import time

    def _perf_cmdline(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                text = f.read().replace(b"\0", b" ").decode(errors="replace")
            return " ".join(text.split())[:2000]
        except OSError:
            return "?"

    def _perf_parent(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    def _perf_sample(path, main, start):
        with open(path, "a", buffering=1) as out:
            while True:
                time.sleep(1.0)
                frame = sys._current_frames().get(main)
                frames = []
                while frame is not None and len(frames) < 40:
                    code = frame.f_code
                    frames.append(f"{code.co_filename}:{frame.f_lineno}:{code.co_name}")
                    frame = frame.f_back
                out.write(f"{time.monotonic() - start:.1f}\t" + "\t".join(frames) + "\n")

    def _perf_start():
        folder = os.environ["PERF_TEST_PYTHON_SAMPLES"]
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            return
        path = os.path.join(folder, f"{os.getpid()}.txt")
        try:  # a folder it cannot write to leaves this Python unsampled, and otherwise as it was
            with open(path, "w") as out:
                pid = os.getpid()
                for level in range(6):  # this process, then its parents: the test's own is among them
                    out.write(f"# {level} {pid}: {_perf_cmdline(pid)}\n")
                    pid = _perf_parent(pid)
                    if pid <= 1:
                        break
        except OSError:
            return
        threading.Thread(target=_perf_sample, args=(path, threading.main_thread().ident, time.monotonic()),
                         name="perf-test-python-samples", daemon=True).start()

    _perf_start()
