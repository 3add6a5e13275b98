# test_util::python()'s server (tests/test_util.h): imports torch once, then runs each snippet it is sent in a
# child forked from it, as `python -c` would run it there, its stdout and stderr in the files the request names.
# A test binary's snippets (60 in the quick tests) each paid about 2 s importing torch in a Python of its own.
#
# Requests on fd 0 (a socket): four fields, each "<length>\n<bytes>": the code, the stdout and stderr paths and the
# working directory. The reply, once the child has ended: its wait status as os.waitpid gives it, and "\n".
# Nothing here runs a torch operation before forking: the children start from a process without threads.
import atexit
import os
import random
import sys
import threading
import traceback

import torch  # noqa: F401  (what each snippet's own `import torch` then finds done)


def read_exact(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def field():
    length = b""
    while not length.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            raise EOFError
        length += c
    return read_exact(int(length)).decode()


def exit_status(e):  # SystemExit's code as Python's own exit turns it into a status
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def child(code, out, err, cwd):
    status = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # not the server's socket: a process the snippet leaves behind must not hold it
        os.close(null)
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(cwd)
        sys.argv[:] = ["-c"]
        sys.path[0] = ""  # `python -c`'s: the working directory
        random.seed()  # each child its own draws, as each fresh Python: Python's, torch's and numpy's
        torch.seed()
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()
        try:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            status = 0
        except SystemExit as e:
            status = exit_status(e)
        except BaseException:
            kind, value, tb = sys.exc_info()
            traceback.print_exception(kind, value, tb.tb_next)  # from the snippet's frame, as `python -c` prints
            status = 1
        threading._shutdown()  # what the interpreter's exit does: wait for the snippet's non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


def main():
    while True:
        try:
            request = [field() for _ in range(4)]
        except EOFError:  # the test binary has ended
            return
        pid = os.fork()
        if pid == 0:
            child(*request)
        _, status = os.waitpid(pid, 0)
        os.write(0, f"{status}\n".encode())


main()
