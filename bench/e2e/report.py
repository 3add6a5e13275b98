"""Table (markdown) and charts (PNG) from bench/e2e/run.py's results.jsonl.

    python bench/e2e/report.py bench-results/e2e/results.jsonl --docs docs --name e2e-cpu
writes docs/<name>.md, docs/<name>-throughput.png and docs/<name>-loss.png (without matplotlib: the
table only).

Runs are kept so that a later report can draw on them (bench/runs.py): --keep DIR writes the new run's rows into
DIR/<name>-<UTC date and time>-<commit>.jsonl, each row with a "run" entry (machine, commit, date, torch,
command). Given several results files, kept runs first and the new one last, each job's section comes from the
last file that has the job, and names its run where they differ (a GPU call that runs one job leaves the other
job's section as its own run wrote it):

    python bench/e2e/report.py docs/runs/e2e-cuda-*.jsonl --append docs/runs/e2e-cuda-unkept.md \\
        --docs docs --name e2e-cuda

(--append ends the document with the sections of earlier runs whose rows were not kept.)"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: runs.py
from charts import plt  # noqa: E402  (None without matplotlib: the table only)
from runs import arguments, describe, distinct_runs, gather, one_device  # noqa: E402

LABELS = {  # in the tables' order: each Python configuration beside its C++ peer
    ("python", "eager_fp32"): "Python eager fp32",
    ("cpp", "stock"): "C++ stock LibTorch fp32",
    ("python", "eager_recipe"): "Python eager + recipe",
    ("cpp", "perf"): "C++ perf recipe",
    ("python", "compile_recipe"): "Python torch.compile + recipe",
    ("cpp", "perf_compiled"): "C++ perf CompiledTrainStep (Inductor AOT)",
    ("cpp", "perf_trainstep"): "C++ perf + TrainStep (CUDA graph)",
    ("python", "compile_reduce_overhead"): "Python compile reduce-overhead + recipe",
    ("cpp", "perf_compiled_graph"): "C++ perf CompiledTrainStep, one CUDA graph",
    ("python", "compile_max_autotune"): "Python compile max-autotune + recipe",
}


def label_of(r):
    label = LABELS.get((r["lang"], r["config"]), f"{r['lang']} {r['config']}")
    if r.get("package_layout") == "contiguous" and r["job"] == "cnn":  # run.py --compiled-layout contiguous
        label += ", contiguous package"
    if r.get("package_options"):  # run.py --compiled-max-autotune, --compiled-inductor-config
        label += f", {r['package_options']}"
    if r.get("diagnosis"):  # run.py --diagnose, --cpp-cudnn-benchmark off, --cpp-check-syncs off
        label += f" ({r['diagnosis']})"
    return label


def median_runs(rows):
    """One row per (job, language, configuration, diagnosis): the first run's, with the median run's samples/s and
    every run's in "runs" (run.py --repeat runs each configuration several times)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["job"], r["lang"], r["config"], r.get("diagnosis")), []).append(r)
    out = []
    for runs in groups.values():
        speeds = sorted(r["samples_per_s"] for r in runs)
        row = dict(runs[0], runs=speeds)
        row["samples_per_s"] = speeds[(len(speeds) - 1) // 2] if len(speeds) % 2 else \
            (speeds[len(speeds) // 2 - 1] + speeds[len(speeds) // 2]) / 2
        out.append(row)
    return out


def goals(rs, failed, job, device):
    """The compiled-training goals a job's rows can be held to, each with its figures and whether it is met: on CUDA
    (the CNN and the transformer) the compiled step in one CUDA graph >= 1.15x Python's torch.compile + recipe and
    >= 1.0x its reduce-overhead and max-autotune modes; on the CPU (every job) the compiled step >= 1.0x
    torch.compile + recipe. The C++ row judged is the fastest of its configuration (a --diagnose retry or another
    package's included, named); a goal whose rows the run lacks says so."""
    if device == "cuda" and job not in ("cnn", "transformer"):
        return []
    key = "perf_compiled_graph" if device == "cuda" else "perf_compiled"
    peers = [("compile_recipe", 1.15 if device == "cuda" else 1.0)]
    if device == "cuda":
        peers += [("compile_reduce_overhead", 1.0), ("compile_max_autotune", 1.0)]
    mine = [r for r in rs if (r["lang"], r["config"]) == ("cpp", key)]
    if not mine:
        why = "the C++ row failed in this run, above" if any(r["config"] == key for r in failed) else \
            "no C++ row in this run"
        return [f"{LABELS[('cpp', key)]} against {LABELS[('python', k)]} (goal >= {g}x: not judged: {why})"
                for k, g in peers]
    best = max(mine, key=lambda r: r["samples_per_s"])
    out = []
    for k, g in peers:
        peer = next((r for r in rs if (r["lang"], r["config"]) == ("python", k)), None)
        if peer is None:
            why = "the Python row failed in this run" if any(r["config"] == k for r in failed) else \
                "no Python row in this run"
            out.append(f"{label_of(best)} against {LABELS[('python', k)]} (goal >= {g}x: not judged: {why})")
            continue
        ratio = best["samples_per_s"] / peer["samples_per_s"]
        out.append(f"{label_of(best)} ({best['samples_per_s']:.1f} samples/s): {ratio:.2f}x {label_of(peer)} "
                   f"({peer['samples_per_s']:.1f}) (goal >= {g}x: {'met' if ratio >= g else 'not met'})")
    return out


def final_loss(r, last=3):
    tail = r["losses"][-last:]
    return sum(tail) / len(tail)


def main():
    p = arguments(__doc__, "run.py's results.jsonl, or kept runs (--keep) first and it last", "e2e-cpu")
    p.add_argument("--append", action="append", default=[], metavar="FILE.md",
                   help="markdown to end the document with, as it is: sections of runs whose rows were not kept")
    a = p.parse_args()
    appended = []
    for path in a.append:
        if not os.path.isfile(path):
            p.error(f"--append {path}: no such file")
        with open(path) as f:
            appended.append(f.read().strip() + "\n")
    source = gather(a, "report.py", lambda r: r["job"])  # each job from the last file that has it
    jobs = list(source)
    chosen = [r for job in jobs for r in source[job]]
    device = one_device(source, "report.py", "docs/e2e-cpu*.md, docs/e2e-cuda.md")
    rows = median_runs([r for r in chosen if "failed" not in r])  # run.py's row for a run that failed: no figures
    failures = [r for r in chosen if "failed" in r]
    repeats = max([len(r["runs"]) for r in rows] or [1])
    distinct = distinct_runs(source)
    os.makedirs(a.docs, exist_ok=True)

    one = distinct[0]
    md = [f"# End-to-end training: Python PyTorch vs C++ with perf ({device})", ""]
    md += [(f"Machine: {one['machine']}; torch {one['torch']}; commit `{one['commit']}`." if len(distinct) == 1 else
            "Each job's section comes from its own run, named under its heading (bench/e2e/report.py on the runs "
            "kept in docs/runs/).") +
           " Each row is one process training the job from the same saved weights on the same "
           "batches; throughput is the median over windows of steps after warm-up (samples/s), relative to Python "
           "eager fp32 (where a run left that row out, to the job's first row); final loss is the mean of the last 3 "
           "steps' losses. `first step` includes torch.compile's compilation where it applies. Generated by "
           "bench/e2e/report.py from bench/e2e/run.py." + (
               f" Every configuration ran {repeats} times, in rounds (run.py --repeat): samples/s is the median "
               "run's, with the slowest and fastest run's in brackets; final loss and first step are the first run's."
               if repeats > 1 else "") + (
               f" This run: {one['date']}, `{one['command']}`." if len(distinct) == 1 and one.get("command") else ""),
           ""]
    charts = []  # per job: (job, the ratios' base, names, ratios, colors, loss curves)
    for job in jobs:
        order = list(LABELS)  # the table's order, whatever order the runs ran in (run.py configs)
        rs = sorted((r for r in rows if r["job"] == job),
                    key=lambda r: order.index((r["lang"], r["config"])) if (r["lang"], r["config"]) in order else
                    len(order))
        failed = [r for r in failures if r["job"] == job]
        # Only where no run of the configuration trained (with --repeat, another run may have).
        failed_only = [r for r in dict((label_of(r), r) for r in failed).values()
                       if not any(label_of(t) == label_of(r) for t in rs)]
        r0 = (rs or failed)[0]
        md += [f"## {job} (batch {r0['batch']}, {r0['warmup']} warm-up + {r0['steps']} timed steps"
               + (f", {r0['threads']} threads)" if "threads" in r0 else ")"), ""]
        if len(distinct) > 1:
            md += [f"Run: {describe(r0['run'])}.", ""]
        if not rs:
            md += ["Every run of this job failed:", ""] + [f"- {label_of(r)}: {r['failed']}" for r in failed] + [""]
            continue
        # Ratios to Python eager fp32; a run without that row (run.py --configs) is relative to its first row.
        base = next((r for r in rs if (r["lang"], r["config"]) == ("python", "eager_fp32")), rs[0])
        base_label = label_of(base)
        ref_loss = final_loss(base)
        if base_label != "Python eager fp32":
            why = "its run failed" if any(r["config"] == "eager_fp32" for r in failed) else "run.py --configs"
            md += [f"No Python eager fp32 row in this run ({why}): ratios are to {base_label}.", ""]
        md += [f"| configuration | samples/s | vs {base_label} | first step | final loss | autocast |",
               "| --- | --- | --- | --- | --- | --- |"]
        names, ratios, colors, curves = [], [], [], []
        for r in rs:
            label = label_of(r)
            ratio = r["samples_per_s"] / base["samples_per_s"]
            spread = f" ({min(r['runs']):.1f}-{max(r['runs']):.1f})" if len(r["runs"]) > 1 else ""
            md.append(f"| {label} | {r['samples_per_s']:.1f}{spread} | {ratio:.2f}x | {r['first_step_s']:.2f} s | "
                      f"{final_loss(r):.4f} | {r['amp']} |")
            names.append(label.replace("Python ", "Py ").replace(" + recipe", "+R"))
            ratios.append(ratio)
            colors.append("tab:blue" if r["lang"] == "python" else "tab:orange")
            curves.append((label, r["losses"]))
        for r in failed_only:
            md.append(f"| {label_of(r)} | failed (below) | | | | |")
            names.append(label_of(r).replace("Python ", "Py ").replace(" + recipe", "+R"))
            ratios.append(None)  # no bar: "failed" in the chart
            colors.append("tab:blue" if r["lang"] == "python" else "tab:orange")
        if failed:
            md += [""] + [f"Failed: {label_of(r)}: {r['failed'].rstrip('.')}." for r in failed]
        stock = next((r for r in rs if r["config"] == "stock"), None)
        if stock is not None and base is not stock:
            diffs = [abs(u - v) for u, v in zip(base["losses"], stock["losses"])]
            close = next((i for i, d in enumerate(diffs) if d > 1e-5), len(diffs))
            if close == len(diffs):
                md += ["", f"Python eager fp32 and C++ stock run the same fp32 job: their losses agree within "
                           f"{max(diffs):.1e} at every step."]
            else:
                # Same ops, other summation orders (threads): rounding differences
                # that training amplifies step by step, not a different job.
                md += ["", f"Python eager fp32 and C++ stock run the same fp32 job: their losses agree within "
                           f"{max(diffs[:close] or [0.0]):.1e} for the first {close} steps; from there the two "
                           f"runs' rounding differences compound, as between any two fp32 runs whose kernels sum "
                           f"in another order (largest difference {max(diffs):.1e}, step {diffs.index(max(diffs)) + 1})."]
        exported = [r for r in rs if r.get("export_s")]
        if exported:
            md += ["", f"C++ CompiledTrainStep runs a package exported ahead of time by tools/export_compiled.py "
                       f"--train ({exported[0]['export_s']:.0f} s, once; cached), so its first step has no "
                       "compilation in it."]
        mixed = [r for r in rs if r["amp"] != "off" and r is not base]
        if mixed:
            md += ["", f"Final loss minus {base_label}'s (bf16 autocast rounds differently): " + ", ".join(
                f"{label_of(r)} {final_loss(r) - ref_loss:+.4f}" for r in mixed)
                + "."]
        judged = goals(rs, failed, job, device)
        if judged:
            md += ["", "Against the compiled-training goals:", ""] + [f"- {g}" for g in judged]
        md.append("")
        title = job if len(distinct) == 1 else f"{job} ({r0['run']['machine']}, {r0['run']['commit']})"
        charts.append((title, base_label, names, ratios, colors, curves))
    if plt is not None and charts:
        plot(charts, device, a.docs, a.name)
        md += [f"![throughput]({a.name}-throughput.png)", "", f"![loss]({a.name}-loss.png)", ""]
    with open(os.path.join(a.docs, f"{a.name}.md"), "w") as f:
        f.write("\n".join(md + appended))
    print(f"wrote {a.docs}/{a.name}.md and " + ("two charts" if plt is not None and charts else
                                                 "no charts (matplotlib is not installed)" if plt is None else
                                                 "no charts (no run trained)"))


def plot(charts, device, docs, name):
    fig, axes = plt.subplots(1, len(charts), figsize=(5.2 * len(charts), 4.2), squeeze=False)
    lfig, laxes = plt.subplots(1, len(charts), figsize=(5.2 * len(charts), 3.8), squeeze=False)
    for ax, lax, (job, base_label, names, ratios, colors, curves) in zip(axes[0], laxes[0], charts):
        ax.barh(range(len(names)), [v or 0.0 for v in ratios], color=colors)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(1.0, color="gray", linewidth=0.8)
        ax.set_xlim(0, 1.2 * max([v for v in ratios if v] + [1.0]))  # room for the longest bar's label
        ax.set_xlabel(f"throughput vs {base_label}")
        ax.set_title(job.replace(" (", "\n(", 1), fontsize=10)  # the run on its own line: long names fit
        for k, v in enumerate(ratios):
            ax.text(v or 0.0, k, " failed" if v is None else f" {v:.2f}x", va="center", fontsize=8,
                    color="tab:red" if v is None else "black")
        for label, losses in curves:
            lax.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1)
        lax.set_title(f"{job}: loss per step".replace(" (", "\n(", 1), fontsize=10)
        lax.set_xlabel("step")
        lax.legend(fontsize=6)
    fig.suptitle(f"Training throughput, {device} (blue: Python, orange: C++)")
    fig.tight_layout()
    fig.savefig(os.path.join(docs, f"{name}-throughput.png"), dpi=110)
    lfig.tight_layout()
    lfig.savefig(os.path.join(docs, f"{name}-loss.png"), dpi=110)


if __name__ == "__main__":
    main()
