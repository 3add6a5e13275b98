"""Table (markdown) and chart (PNG) from bench_optim's and peer_optim.py's JSON lines.

    python bench/report_optim.py results.jsonl --docs docs --name optim-cpu --machine "..."
writes docs/<name>.md and docs/<name>.png: per parameter set, each pair of configurations that bench_optim timed
alternately (perf::compare) with the ratio between them, Python torch.optim's rows from its own process, every
row's share of the copy bandwidth its process measured, and the flat-optimizer goals judged from the rows. Without
matplotlib: the table only.

--keep DIR also writes the run's rows, each with its run (machine, commit, date, torch, command), into
DIR/<name>-<UTC date and time>-<commit>.jsonl (bench/runs.py). Given kept runs first and a new results file
last, each parameter set's section comes from the last file that has it:

    python bench/report_optim.py docs/runs/optim-cuda-*.jsonl --docs docs --name optim-cuda"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: runs.py
from charts import bar_panels, write_document  # noqa: E402
from runs import about, arguments, describe, distinct_runs, gather, one_device  # noqa: E402



def share(r):
    """The fraction of its process's copy_ bandwidth that a row's step moved."""
    return r["bytes"] / (r["median_ms"] * 1e6) / r["copy_gbs"]


def share_cell(r):
    """share() as a table cell: "-" for a row of compute, not traffic (Muon's, bytes 0)."""
    return f"{100 * share(r):.0f}%" if r["bytes"] else "-"


def pairs(rs):
    """bench_optim's comparisons in this section: [(A row, B row)], in the order they ran."""
    by = {}
    for r in rs:
        if r["lang"] == "cpp":
            by.setdefault(r["compare"], {})[r["side"]] = r
    return [(p["a"], p["b"]) for _, p in sorted(by.items()) if "a" in p and "b" in p]


def judged(ratio, goal, what, strict=False):
    met = ratio > goal if strict else ratio >= goal
    return f"{ratio:.2f}x {what} (goal {'>' if strict else '>='} {goal}x: {'met' if met else 'not met'})"


FLAT = ("(flat)", "(flat, 2 streams)")  # flat mode's rows: its calls on one CUDA stream, or alternated over two


def goals(rs, set_name, device):
    """The flat-optimizer goals this section's rows can be held to, each with its figures and whether it is met.
    On CUDA (ResNet-50): flat AdamW >= 80% of the copy bandwidth, and >= 1.4x the fused multi-tensor AdamW (timed
    alternately with it) and Python's torch.optim.AdamW(fused=True) (its own process, the same call); where the run
    has flat mode's calls on two streams too, that row is held to the same goals. On the CPU: flat >= 1.0x the fused
    path for every optimizer, and faster (> 1.0x) on the transformer's many small tensors."""
    flat = [(a, b) for a, b in pairs(rs) if b["config"].endswith(FLAT) and a["config"].endswith("(fused)")]
    if not flat:
        return []
    out = []
    if device == "cuda":
        if set_name != "ResNet-50":
            return []
        adamw = [(a, b) for a, b in flat if b["optimizer"] == "AdamW"]
        if not adamw:
            return ["perf AdamW (flat) (goal >= 80% of the copy bandwidth, >= 1.4x: not judged: no such row in this "
                    "run)"]
        py = next((r for r in rs if r["config"] == "torch.optim.AdamW (fused)"), None)
        for fused, mine in adamw:
            s = share(mine)
            out.append(f"{mine['config']} moves {100 * s:.0f}% of the copy bandwidth "
                       f"(goal >= 80%: {'met' if s >= 0.8 else 'not met'})")
            out.append(f"{mine['config']}: " + judged(fused["median_ms"] / mine["median_ms"], 1.4,
                                                      f"{fused['config']} (timed alternately)"))
            out.append(f"{mine['config']}: " + (
                judged(py["median_ms"] / mine["median_ms"], 1.4, f"Python {py['config']} (its own process)") if py
                else "against Python torch.optim.AdamW (fused) (goal >= 1.4x: not judged: no Python row in this run)"))
        return out
    strict = set_name == "transformer"
    for fused, mine in flat:
        out.append(f"{mine['config']}: " + judged(fused["median_ms"] / mine["median_ms"], 1.0,
                                                  f"{fused['config']} (timed alternately)", strict))
    return out


def stream_decision(rs):
    """Flat mode's calls on two CUDA streams against the same calls on one, timed alternately: the evidence for
    the setting's default (perf::optim::detail::flat_cuda_streams), or None where the run has no such pair."""
    pair = next(((a, b) for a, b in pairs(rs) if a["config"].endswith("(flat)") and b["config"].endswith(FLAT[1])),
                None)
    if pair is None:
        return None
    one, two = pair
    ratio = one["median_ms"] / two["median_ms"]
    return (f"Flat mode's calls on two streams against the same calls on one (timed alternately): {ratio:.2f}x, "
            f"{100 * share(two):.0f}% of the copy bandwidth against {100 * share(one):.0f}%. Flat mode issues them on "
            "one stream by default; two become the default where they are faster beyond noise on the GPUs measured "
            "(docs/benchmarks.md).")


def main():
    a = arguments(__doc__, "bench_optim's and peer_optim.py's JSON lines, kept runs first", "optim-cpu").parse_args()
    sections = gather(a, "report_optim.py", lambda r: r["set"])  # each parameter set from the last file that has it
    device = one_device(sections, "report_optim.py", "docs/optim-<device>.md")
    distinct = distinct_runs(sections)
    intro = ("Median time of one optimizer step over a parameter set whose gradients are given (fp32), and the share "
             "of the copy bandwidth it reaches: the bytes a step must move (Adam and AdamW read parameter, gradient "
             "and both moments and write three of them, 7 x 4 bytes a parameter; SGD with momentum 5 x 4) over its "
             "time, against a 1 GiB `copy_` (read + write) timed in the same process. "
             + ("On a CPU `copy_` is not the ceiling (the optimizers' kernels reach more than it), so the share "
                "compares rows only. " if device == "cpu" else "")
             + ("The \"EMA\" sections time an exponential moving average of the same weights after a step "
                "(AveragedModel.update_parameters with decay 0.999: reads the average and the weights, writes the "
                "average, 3 x 4 bytes a parameter): perf's over weights in a flat(true) optimizer's buffer (one lerp) "
                "or not (multi-tensor), and Python's. " if any(n.endswith(" EMA") for n in sections) else "")
             + ("The \"Muon\" section times torch.optim.Muon's step over a transformer's 48 weight matrices "
                "(four shapes, twelve of each): perf's Python loop (`foreach(false)`, the same operations as "
                "Python's) against its batched step (one Newton-Schulz batch per shape), and Python's. Its "
                "bfloat16 matrix products are compute, not memory traffic: no share of the copy bandwidth. "
                if any("Muon" in n for n in sections) else "")
             + "C++ rows from bench/bench_optim, Python rows from bench/peer_optim.py, one after the other in one run. "
             "Generated by bench/report_optim.py.")
    md = [f"# Optimizer step: perf::optim against torch::optim and Python torch.optim ({device})", "",
          about(sections, intro, "parameter set"), ""]
    bars = []
    for set_name, rs in sections.items():
        first = rs[0]
        size = (f"one buffer of {first['params']:,} parameters" if first["tensors"] == 1 else
                f"{first['tensors']} tensors, {first['params']:,} parameters")
        md += [f"## {set_name} ({size})", ""]
        if first["tensors"] == 1:
            md += ["bench_optim's launch-geometry probe: the same AdamW update (`at::_fused_adamw_`) as one call over "
                   "the buffer and as calls of k x (SMs on a GPU, threads on a CPU) chunks of 65536 elements, the "
                   "evidence for the calls flat mode issues on CUDA (docs/benchmarks.md). On a CPU it is a control "
                   "(flat mode makes one call there). A run kept before 2026-11-29 may end with a pair that issued flat "
                   "mode's calls alternately on two streams; runs since time that through the optimizer (ResNet-50's "
                   "\"flat, 2 streams\" rows).",
                   ""]
        if len(distinct) > 1:
            md += [f"Run: {describe(first['run'])}.", ""]
        cpp = pairs(rs)
        if cpp:
            md += [f"Each pair timed alternately in one process (perf::compare; copy bandwidth there "
                   f"{cpp[0][0]['copy_gbs']:.1f} GB/s):", "",
                   "| A | median ms | share of copy | B | median ms | share of copy | B vs A |",
                   "| --- | --- | --- | --- | --- | --- | --- |"]
            md += [f"| {x['config']} | {x['median_ms']:.3f} | {share_cell(x)} | {y['config']} | "
                   f"{y['median_ms']:.3f} | {share_cell(y)} | {x['median_ms'] / y['median_ms']:.2f}x |"
                   for x, y in cpp]
            md.append("")
        py = [r for r in rs if r["lang"] == "python"]
        flat = {b["optimizer"]: b for _, b in cpp if b["config"].endswith("(flat)")}
        batched = {b["optimizer"]: b for _, b in cpp if b["optimizer"] == "Muon" and b["config"].endswith("(foreach)")}
        if py:
            compute = not py[0]["bytes"]
            md += [f"Python `torch.optim` in its own process, the same call (copy bandwidth there "
                   f"{py[0]['copy_gbs']:.1f} GB/s); the last column is perf's "
                   f"{'batched step' if compute else 'flat mode'} of the same optimizer against it:", "",
                   f"| configuration | median ms | share of copy | perf {'foreach' if compute else 'flat'} vs it |",
                   "| --- | --- | --- | --- |"]
            for r in py:
                mine = flat.get(r["optimizer"]) or batched.get(r["optimizer"])
                versus = f"{r['median_ms'] / mine['median_ms']:.2f}x" if mine else "-"
                md.append(f"| {r['config']} | {r['median_ms']:.3f} | {share_cell(r)} | {versus} |")
            md.append("")
        lines = goals(rs, set_name, device)
        if lines:
            md += ["Against the flat-optimizer goals:", ""] + [f"- {g}" for g in lines] + [""]
        decision = stream_decision(rs)
        if decision:
            md += [decision, ""]
        if not first["bytes"]:  # compute, not traffic: no bandwidth bars
            continue
        seen = {}
        for r in [x for pair in cpp for x in pair] + py:  # a configuration in two pairs: its first
            seen.setdefault((r["lang"], r["config"]), r)
        title = set_name if len(distinct) == 1 else f"{set_name} ({first['run']['commit']})"
        bars.append((title, [r["config"] for r in seen.values()], [100 * share(r) for r in seen.values()],
                     ["tab:blue" if r["lang"] == "python" else "tab:orange" for r in seen.values()],
                     "share of the copy bandwidth, % (higher is faster)"))
    # In the table's order, top down; on CUDA a dashed line at the flat-optimizer goal (80%).
    write_document(a, md, lambda path: bar_panels(bars, f"Optimizer step, {device} (blue: Python, orange: C++)", path,
                                                  label=lambda v: f"{v:.0f}%", ref=100,
                                                  goal=80 if device == "cuda" else None, top_down=True),
                   "share of copy bandwidth")


if __name__ == "__main__":
    main()
