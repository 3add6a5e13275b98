"""What the reports draw (bench/e2e/report.py, bench/report_compiled.py, bench/report_optim.py): matplotlib where it
is installed (`plt`, else None: the tables need nothing, and an offline GPU machine has no matplotlib), panels of
horizontal bars, and a report's document with its chart."""
import os

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    plt = None


def bar_panels(panels, title, path, label, ref, goal=None, top_down=False):
    """One panel of horizontal bars under the other (the names are long), each panel (title, names, values, colors,
    x-axis label): `label(v)` beside each bar, a gray line at `ref`, a dashed green one at `goal` where given."""
    heights = [0.3 * len(p[1]) + 1.0 for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, sum(heights) + 0.6), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (name, names, values, colors, xlabel) in zip(axes[:, 0], panels):
        ax.barh(range(len(names)), values, color=colors)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        if top_down:
            ax.invert_yaxis()
        ax.axvline(ref, color="gray", linewidth=0.8)
        if goal is not None:
            ax.axvline(goal, color="tab:green", linewidth=0.8, linestyle="--")
        ax.set_xlim(0, max(list(values) + [ref]) * 1.12)  # room for the last bar's label
        ax.set_xlabel(xlabel)
        ax.set_title(name)
        for k, v in enumerate(values):
            ax.text(v, k, f" {label(v)}", va="center", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_document(a, md, draw, alt):
    """<a.docs>/<a.name>.md from the lines `md`, ending with the chart `draw(path)` writes to <a.name>.png where
    matplotlib is installed."""
    os.makedirs(a.docs, exist_ok=True)
    if plt is not None:
        draw(os.path.join(a.docs, f"{a.name}.png"))
        md = md + [f"![{alt}]({a.name}.png)", ""]
    with open(os.path.join(a.docs, f"{a.name}.md"), "w") as f:
        f.write("\n".join(md))
    print(f"wrote {a.docs}/{a.name}.md and " +
          (f"{a.docs}/{a.name}.png" if plt is not None else "no chart (matplotlib is not installed)"))
