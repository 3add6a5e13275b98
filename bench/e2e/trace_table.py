"""Where a training step's time goes, from the traces bench/e2e/run.py --profile-steps N asks every configuration
for: N more steps after the timed ones, traced by LibTorch's profiler (e2e.cpp, perf::Profile) or torch.profiler
(train.py), both Kineto's Chrome trace, inside one "e2e_profiled_steps" range that ends after a sync.

On a GPU: the wall time per step (that range), the time the GPU was busy (the union of its kernels, copies and
sets), the device time by kind of kernel (cuDNN's convolutions, matmuls, attention, Triton's fused kernels, the
optimizer's, other ATen kernels, copies and sets), and the kernels that took the most device time. On the CPU: the operators with the most self time (their
time less that of the operators nested in them). Python and C++ are read the same way, so their rows compare.

    python bench/e2e/trace_table.py TRACE.json STEPS   # one trace's summary

--calls reads traces where each call of a configuration ran in its own range "call: <configuration>", after a sync
(bench_compiled's --profile-traces): per configuration, the median call split into the host's part before the
device's first operation, the device's span from that operation's start to the last one's end, and the idle gaps in
it, with the widest of them. Two rows that run the same kernels at different speeds differ in one of those.

    python bench/e2e/trace_table.py --calls TRACE.json...

--diff compares two such traces of one configuration each, operation by operation in their median calls: where
the second's extra time is (the device's start, busy time, idle gaps), the first operation whose kernel or launch
dimensions differ, and the gaps that grew the most, each before which operation.

    python bench/e2e/trace_table.py --diff A.json B.json
"""
import json
import sys

RANGE = "e2e_profiled_steps"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Kinds of device work, in the order of the markdown's columns: (kind, marks), the first kind one of whose marks a
# kernel's name (lowercase) has; "other ATen kernels" for the rest, "copies and sets" for memcpy/memset events.
# Inductor's kernels first ("triton_" begins their names, which often say "convolution_backward": an epilogue), then
# attention (names with "cutlass" among them), and cuDNN's convolutions before the matmuls (theirs say "implicit_gemm").
KINDS = (("fused (Triton)", ("triton_",)),
         ("attention", ("flash", "fmha", "attention")),
         ("convolutions (cuDNN)", ("fprop", "dgrad", "wgrad", "implicit_gemm", "cudnn", "convolution", "conv2d",
                                   "conv_", "nchwtonhwc", "nhwctonchw")),
         ("matmuls", ("gemm", "cutlass", "cublas")),
         ("optimizer (multi-tensor)", ("multi_tensor_apply", "fused_adam", "fusedadam", "fused_sgd")))
OTHER, COPIES = "other ATen kernels", "copies and sets"


def kind(name: str, category: str = "kernel") -> str:
    """The kind of one device event (KINDS)."""
    if category != "kernel":
        return COPIES
    low = name.lower()
    return next((k for k, marks in KINDS if any(m in low for m in marks)), OTHER)


def summarize(path: str, steps: int, top: int = 12) -> dict:
    """The trace at `path` of `steps` profiled steps: {"device": "cuda" or "cpu", "steps", "wall_ms" (per step),
    "busy_ms" (GPU busy per step; on the CPU, operators' self time per step), "events" (kernels or operators per
    step), "rows": [(name, calls per step, ms per step, share of busy_ms)] for the `top` names with the most time,
    "kinds": {kind: (events per step, ms per step)} on a GPU (device time summed, so work that overlaps on two
    streams counts twice; empty on the CPU)}."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == RANGE]
    if len(ranges) != 1:
        raise ValueError(f"{path}: {len(ranges)} '{RANGE}' ranges, expected 1 (a trace from e2e.cpp or train.py "
                         "--profile-steps)")
    start, end = ranges[0]["ts"], ranges[0]["ts"] + ranges[0]["dur"]
    inside = [e for e in events if start <= e["ts"] <= end]  # a kernel may end a clock skew past the range
    device = [e for e in inside if e.get("cat") in DEVICE_CATEGORIES]
    kinds = {}
    if device:
        timed, busy = [(e["name"], e["dur"]) for e in device], _union(device)
        for e in device:
            k = kind(e["name"], e["cat"])
            calls, total = kinds.get(k, (0, 0.0))
            kinds[k] = (calls + 1, total + e["dur"])
    else:
        timed = _self_times([e for e in inside if e.get("cat") == "cpu_op"])
        busy = sum(d for _, d in timed)
    totals = {}
    for name, dur in timed:
        calls, total = totals.get(name, (0, 0.0))
        totals[name] = (calls + 1, total + dur)
    whole = sum(total for _, total in totals.values()) or 1.0
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return {"device": "cuda" if device else "cpu", "steps": steps, "wall_ms": ranges[0]["dur"] / 1e3 / steps,
            "busy_ms": busy / 1e3 / steps, "events": len(timed) / steps,
            "rows": [(name, calls / steps, total / 1e3 / steps, total / whole) for name, (calls, total) in rows],
            "kinds": {k: (calls / steps, total / 1e3 / steps) for k, (calls, total) in kinds.items()}}


def line(label: str, s: dict) -> str:
    """One line for a log: wall and busy time per step."""
    if s["device"] == "cuda":
        return (f"{label}: {s['wall_ms']:.2f} ms/step, GPU busy {s['busy_ms']:.2f} ms "
                f"({100 * s['busy_ms'] / s['wall_ms']:.0f}%), {s['events']:.0f} kernels/step")
    return f"{label}: {s['wall_ms']:.2f} ms/step, operators' self time {s['busy_ms']:.2f} ms, {s['events']:.0f} ops/step"


def markdown(job: str, entries: list) -> str:
    """The job's section: [(label, summary or an error text)] as one overview table and each configuration's top
    kernels (operators on the CPU)."""
    done = [(label, s) for label, s in entries if isinstance(s, dict)]
    cuda = any(s["device"] == "cuda" for _, s in done)
    steps = max((s["steps"] for _, s in done), default=0)
    out = [f"## {job}: where a step's time goes ({steps} profiled steps after the timed ones)", ""]
    if cuda:
        out += ["| configuration | wall ms/step | GPU busy ms/step | GPU busy | kernels/step |",
                "| --- | --- | --- | --- | --- |"]
        out += [f"| {label} | {s['wall_ms']:.2f} | {s['busy_ms']:.2f} | {100 * s['busy_ms'] / s['wall_ms']:.0f}% | "
                f"{s['events']:.0f} |" for label, s in done]
    else:
        out += ["| configuration | wall ms/step | operators' self ms/step | operators/step |", "| --- | --- | --- | --- |"]
        out += [f"| {label} | {s['wall_ms']:.2f} | {s['busy_ms']:.2f} | {s['events']:.0f} |" for label, s in done]
    out += [f"| {label} | no profile: {s} |" + " |" * (3 if cuda else 2) for label, s in entries if not isinstance(s, dict)]
    if cuda:
        order = [k for k, _ in KINDS] + [OTHER, COPIES]
        present = [k for k in order if any(k in s.get("kinds", {}) for _, s in done)]
        out += ["", "Device time by kind of kernel, ms/step (kernels/step); summed, so work that overlaps on two streams "
                "counts twice:", "", "| configuration | " + " | ".join(present) + " |",
                "| --- |" + " --- |" * len(present)]
        for label, s in done:
            kinds = s.get("kinds", {})
            cells = [f"{kinds[k][1]:.2f} ({kinds[k][0]:g})" if k in kinds else "-" for k in present]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    if not cuda:
        out += ["", "On the CPU, code a compiler generated is no operator, nor is what an AOTInductor package calls "
                "past the dispatcher (its convolutions' backward): a compiled row's wall time has it, its operators' "
                "self time does not."]
    for label, s in done:
        out += ["", f"### {label}: top {'kernels' if cuda else 'operators (self time)'}", "",
                "| name | calls/step | ms/step | share |", "| --- | --- | --- | --- |"]
        out += [f"| `{_short(name)}` | {calls:g} | {ms:.3f} | {100 * share:.1f}% |" for name, calls, ms, share in s["rows"]]
    return "\n".join(out) + "\n"


CALL = "call: "


def calls(path: str, gaps: int = 3) -> dict:
    """The calls traced at `path`, each in a range named CALL + its configuration, the device idle at its start (a
    sync before it): {configuration: {"calls", and the median call's (by "total_us") "total_us" (from the range's
    start to the last device operation's end), "host_us" (the range: the call on the host), "start_us" (from the
    range's start to the device's first operation), "span_us" (first operation's start to last one's end),
    "busy_us" (the operations' union), "operations", "gaps": [(idle us, the operation after it)] the `gaps` widest
    between its operations}}. A call's operations are those that start from its range's start up to the next
    call's."""
    out = {}
    for name, cs in _calls(path).items():
        median = _median(cs)
        idle = [(g, e["name"]) for g, e in zip(_gaps_before(median), median["ops"]) if g > 0][1:]
        out[name] = {k: v for k, v in median.items() if k not in ("ops", "range")}
        out[name].update(calls=len(cs), gaps=sorted(idle, key=lambda g: -g[0])[:gaps])
    return out


def diff(path_a: str, path_b: str, top: int = 3) -> str:
    """Two traces of one configuration each (--calls' ranges), their median calls side by side: the second's time
    against the first's, split as calls() splits it, then the first operation whose name or launch dimensions
    (grid, block) differ, and the `top` gaps before an operation that grew the most where both run the same
    operations."""
    (name_a, a), (name_b, b) = (_one_configuration(p) for p in (path_a, path_b))
    idle_a, idle_b = a["span_us"] - a["busy_us"], b["span_us"] - b["busy_us"]
    lines = [f"diff of {name_b} ({b['total_us']:.1f} us a call) against {name_a} ({a['total_us']:.1f} us): "
             f"{b['total_us'] - a['total_us']:+.1f} us; the device's start {b['start_us'] - a['start_us']:+.1f} us, "
             f"busy {b['busy_us'] - a['busy_us']:+.1f} us, idle {idle_b - idle_a:+.1f} us; "
             f"{len(a['ops'])} against {len(b['ops'])} operations"]
    launch = [[(e["name"], e.get("args", {}).get("grid"), e.get("args", {}).get("block")) for e in c["ops"]]
              for c in (a, b)]
    first = next((i for i, (x, y) in enumerate(zip(*launch)) if x != y), None)
    if first is None and len(launch[0]) == len(launch[1]):
        lines.append("the same operations in the same order, with the same grids and blocks")
        grown = sorted(((gb - ga, i) for i, (ga, gb) in enumerate(zip(_gaps_before(a), _gaps_before(b)))),
                       reverse=True)[:top]
        lines.append("gaps that grew the most: " + ("; ".join(
            f"{d:+.1f} us before #{i} {_short(a['ops'][i]['name'], 60)}" for d, i in grown if d > 0) or "none"))
    else:
        i = first if first is not None else min(len(launch[0]), len(launch[1]))
        said = lambda ops, k: (f"{_short(ops[k][0], 60)} grid {ops[k][1]} block {ops[k][2]}"  # noqa: E731
                               if k < len(ops) else "none")
        lines.append(f"first difference at operation #{i}: {said(launch[0], i)} against {said(launch[1], i)}")
    return "\n".join(lines)


def _calls(path: str) -> dict:
    """{configuration: [{"range", "ops" (its device operations, by start), "total_us", "host_us", "start_us",
    "span_us", "busy_us", "operations"} a call]} (calls())."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    ranges = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith(CALL)),
                    key=lambda e: e["ts"])
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    per = {}
    for i, r in enumerate(ranges):
        until = ranges[i + 1]["ts"] if i + 1 < len(ranges) else float("inf")
        ops = [e for e in device if r["ts"] <= e["ts"] < until]
        if not ops:
            continue
        end = max(e["ts"] + e["dur"] for e in ops)
        per.setdefault(r["name"][len(CALL):], []).append(
            {"range": r, "ops": ops, "total_us": end - r["ts"], "host_us": r["dur"], "start_us": ops[0]["ts"] - r["ts"],
             "span_us": end - ops[0]["ts"], "busy_us": _union(ops), "operations": len(ops)})
    return per


def _median(cs: list) -> dict:
    return sorted(cs, key=lambda c: c["total_us"])[(len(cs) - 1) // 2]


def _gaps_before(call: dict) -> list:
    """The idle microseconds before each of a call's operations: the first's from the range's start (the device's
    start), each next one's from the latest end before it (0 where it overlaps)."""
    out, reach = [], call["range"]["ts"]
    for e in call["ops"]:
        out.append(max(0.0, e["ts"] - reach))
        reach = max(reach, e["ts"] + e["dur"])
    return out


def _one_configuration(path: str) -> tuple:
    found = _calls(path)
    if len(found) != 1:
        raise ValueError(f"{path}: {len(found)} configurations with device operations "
                         f"({', '.join(sorted(found)) or 'none'}); --diff takes traces of one each")
    name, cs = next(iter(found.items()))
    return name, _median(cs)


def calls_line(name: str, c: dict) -> str:
    """One line for a log: a configuration's median call from calls()."""
    widest = "; ".join(f"{us:.1f} us before {_short(op, 60)}" for us, op in c["gaps"]) or "none"
    return (f"calls of {name}: {c['total_us']:.1f} us a call (median of {c['calls']}): the device starts "
            f"{c['start_us']:.1f} us in (the call takes {c['host_us']:.1f} us on the host), then spans "
            f"{c['span_us']:.1f} us, busy {c['busy_us']:.1f} us, idle {c['span_us'] - c['busy_us']:.1f} us between "
            f"{c['operations']} operation{'s' if c['operations'] != 1 else ''}; widest gaps: {widest}")


def _union(events) -> float:
    """Microseconds covered by at least one of the events (kernels on several streams overlap)."""
    covered, reach = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        begin, end = max(e["ts"], reach), e["ts"] + e["dur"]
        if end > begin:
            covered += end - begin
        reach = max(reach, end)
    return covered


def _self_times(ops) -> list:
    """(name, self microseconds) per operator: its duration less that of the operators directly inside it on its
    thread."""
    out, stack = [], []  # stack: (index into out, end, thread) of the enclosing operators
    for e in sorted(ops, key=lambda e: (e.get("tid"), e["ts"], -e["dur"])):
        while stack and (stack[-1][2] != e.get("tid") or stack[-1][1] <= e["ts"]):
            stack.pop()
        if stack:
            parent = stack[-1][0]
            out[parent] = (out[parent][0], out[parent][1] - e["dur"])
        out.append((e["name"], e["dur"]))
        stack.append((len(out) - 1, e["ts"] + e["dur"], e.get("tid")))
    return [(name, max(0.0, d)) for name, d in out]


def _short(name: str, width: int = 100) -> str:
    name = name.replace("|", "/").replace("`", "'")
    return name if len(name) <= width else name[: width - 3] + "..."


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--calls":
        for trace in sys.argv[2:]:
            found = calls(trace)
            if not found:
                print(f"{trace}: no '{CALL}...' range with device operations in it")
            for name, c in found.items():
                print(calls_line(name, c))
        sys.exit(0)
    if len(sys.argv) == 4 and sys.argv[1] == "--diff":
        print(diff(sys.argv[2], sys.argv[3]))
        sys.exit(0)
    if len(sys.argv) != 3:
        sys.exit("usage: trace_table.py TRACE.json STEPS, trace_table.py --calls TRACE.json..., or "
                 "trace_table.py --diff A.json B.json")
    summary = summarize(sys.argv[1], int(sys.argv[2]))
    print(line(sys.argv[1], summary))
    for name, calls, ms, share in summary["rows"]:
        print(f"  {ms:9.3f} ms  {calls:6g}x  {100 * share:5.1f}%  {_short(name)}")
