"""Table (markdown) and chart (PNG) from bench_compiled's and peer_compiled.py's JSON lines.

    python bench/report_compiled.py results.jsonl --docs docs --name compiled-cpu --machine "..."
writes docs/<name>.md and docs/<name>.png: per batch size, every configuration's
median latency and its speed relative to LibTorch eager fp32 (and to Python's
best torch.compile mode), and how perf::optimize decided. Without matplotlib: the table only.

--keep DIR also writes the run's rows, each with its run (machine, commit, date, torch, command), into
DIR/<name>-<UTC date and time>-<commit>.jsonl (bench/runs.py). Given kept runs first and a new results file
last, each batch size's section comes from the last file that has it:

    python bench/report_compiled.py docs/runs/compiled-cuda-*.jsonl --docs docs --name compiled-cuda"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: runs.py
from charts import bar_panels, write_document  # noqa: E402
from runs import about, arguments, describe, distinct_runs, gather, one_device  # noqa: E402


BASE = "C++ eager fp32"


def decision(r):
    """How perf::optimize decided, where bench_compiled wrote it (rows of perf::optimize configurations)."""
    parts = [f"first calls {r['first_calls_s']:.2f} s"] if "first_calls_s" in r else []
    if "captures_s" in r and (r["captures_s"] or r["device"] == "cuda"):
        parts.append(f"CUDA graph captures {r['captures_s']:.2f} s")
    return (f"{r['config']}: {r['recipe']}, decided in {r['decision_s']:.2f} s"
            + (f" ({', '.join(parts)})" if parts else ""))


def goals(rs, batch, device):
    """The compiled-inference goals this batch's rows can be held to, each with its figures and whether it is met:
    on CUDA perf::graph of a package >= 1.0x Python's max-autotune and (batch 1) >= 3x eager fp32; perf::optimize
    with the example >= 0.97x eager fp32 and level with the best fixed recipe (within 3%); on the CPU a package
    >= 1.2x eager fp32. A goal whose rows the run does not have says so."""
    by = {r["config"]: r for r in rs}
    eager = by.get(BASE)
    if eager is None:
        return [f"no {BASE} row: the goals, all relative to it but one, are not judged"]

    def best(pred):
        found = [r for r in rs if pred(r["config"])]
        return min(found, key=lambda r: r["median_ms"]) if found else None

    def judged(ratio, goal, what):
        return f"{ratio:.2f}x {what} (goal >= {goal}x: {'met' if ratio >= goal else 'not met'})"

    out = []
    if device == "cuda":
        graphed = best(lambda c: c.startswith("C++ perf::graph(package"))
        if graphed is None:
            out.append("perf::graph of a package: no such row in this run")
        else:
            autotune = by.get("Python torch.compile max-autotune")
            vs_py = (judged(autotune["median_ms"] / graphed["median_ms"], 1.0, autotune["config"]) if autotune else
                     f"Python torch.compile max-autotune: no row in this run ({no_autotune_row(rs)})")
            line = f"{graphed['config']} ({graphed['median_ms']:.3f} ms): {vs_py}"
            if batch == 1:
                line += f"; {judged(eager['median_ms'] / graphed['median_ms'], 3.0, BASE)}"
            out.append(line)
    else:
        package = best(lambda c: c.startswith("C++ package"))
        if package is not None:
            out.append(f"{package['config']} ({package['median_ms']:.3f} ms): "
                       f"{judged(eager['median_ms'] / package['median_ms'], 1.2, BASE)}")
    tuned = by.get("C++ perf::optimize(example)")
    fixed = best(lambda c: c in (BASE, "C++ eager + perf recipe") or c.startswith("C++ perf::graph(eager recipe)"))
    if tuned is not None:
        out.append(f"{tuned['config']} ({tuned['median_ms']:.3f} ms): "
                   f"{judged(eager['median_ms'] / tuned['median_ms'], 0.97, BASE)}; "
                   + judged(fixed["median_ms"] / tuned["median_ms"], 0.97,
                            f"the best fixed recipe, {fixed['config']} ({fixed['median_ms']:.3f} ms), level within 3%"))
    return out


def no_autotune_row(rs):
    """Why a run has no max-autotune row at a batch, from the command that made it: gpu-check's --quick leaves the
    mode out; otherwise Python's peer ended before it (its autotuning takes minutes on CUDA, and a call's budget
    stops the peer where it is, keeping the rows before)."""
    command = next((r["run"].get("command", "") for r in rs if "run" in r), "")
    if "--quick" in command or "--no-max-autotune" in command:
        return "gpu-check's --quick leaves it out" if "--quick" in command else "--no-max-autotune leaves it out"
    return "Python's peer ended before it: its autotuning takes minutes, and the call's budget stops the peer"


def main():
    a = arguments(__doc__, "bench_compiled's and peer_compiled.py's JSON lines, kept runs first",
                  "compiled-cpu").parse_args()
    sections = gather(a, "report_compiled.py", lambda r: r["batch"])  # each batch size from the last file that has it
    device = one_device(sections, "report_compiled.py", "docs/compiled-<device>.md")
    distinct = distinct_runs(sections)
    intro = ("ResNet-style CNN (bench/resnet.h and its twin bench/resnet.py), the same weights' shapes, inference, "
             "median latency per call. C++ rows from bench/bench_compiled, Python rows from bench/peer_compiled.py, "
             "one after the other in one run. Generated by bench/report_compiled.py.")
    md = [f"# Inference: C++ with perf vs Python torch.compile ({device})", "",
          about(sections, intro, "batch size"), ""]
    bars = []  # per batch: (title, names, ratios, colors)
    for batch in sorted(sections):
        rs = sections[batch]
        base = next((r for r in rs if r["config"] == BASE), rs[0])
        compiled_py = [r for r in rs if r["config"].startswith("Python torch.compile")]
        best_py = min(compiled_py, key=lambda r: r["median_ms"]) if compiled_py else None
        md += [f"## batch {batch}", ""]
        if len(distinct) > 1:
            md += [f"Run: {describe(rs[0]['run'])}.", ""]
        if base["config"] != BASE:
            md += [f"No {BASE} row in this run: ratios are to {base['config']}.", ""]
        peer = f" vs {best_py['config']} |" if best_py else ""
        md += [f"| configuration | median ms | vs {base['config']} |{peer}",
               "| --- | --- | --- |" + (" --- |" if peer else "")]
        names, ratios, colors = [], [], []
        for r in sorted(rs, key=lambda r: -r["median_ms"]):
            ratio = base["median_ms"] / r["median_ms"]
            line = f"| {r['config']} | {r['median_ms']:.3f} | {ratio:.2f}x |"
            if best_py:
                line += f" {best_py['median_ms'] / r['median_ms']:.2f}x |"
            md.append(line)
            names.append(r["config"].replace("Python ", "Py ").replace("torch.compile", "compile"))
            ratios.append(ratio)
            colors.append("tab:blue" if r["lang"] == "python" else "tab:orange")
        decided = [r for r in rs if "decision_s" in r]
        if decided:
            md += ["", "perf::optimize's decisions (each recipe measured on this batch; the first calls, where cuDNN "
                       "autotunes in benchmark mode, and the captures are outside `tune_seconds`):", ""]
            md += [f"- {decision(r)}" for r in decided]
        md += ["", "Against the compiled-inference goals:", ""] + [f"- {g}" for g in goals(rs, batch, device)]
        md.append("")
        title = f"batch {batch}" if len(distinct) == 1 else f"batch {batch} ({rs[0]['run']['commit']})"
        bars.append((title, names, ratios, colors, f"speed vs {base['config']} (higher is faster)"))
    write_document(a, md, lambda path: bar_panels(bars, f"Inference, {device} (blue: Python, orange: C++)", path,
                                                  label=lambda v: f"{v:.2f}x", ref=1.0), "latency")


if __name__ == "__main__":
    main()
