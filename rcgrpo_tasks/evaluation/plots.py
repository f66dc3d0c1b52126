"""The plots of evaluate and report: accuracy per model, readable at any accuracy (0 % as well as 85 %), and
the RL cells' fixed-probe curves. Every title is the caller's: it names the task and the split the numbers
come from (`evaluation.accuracy.side_name`).

One horizontal bar per model: overall accuracy with its 95 % CI as an error bar and the value written on
the bar (a 0.0 bar is a labelled line, not an empty plot), the paper's Table 1 value as a star where the
paper gives one; beside it the mean partial credit (0..1), which moves long before accuracy does. The
x-axis stops a little past the largest value shown instead of always at 100 %, so small differences
stay visible; the axis label says so.
"""

from __future__ import annotations

import math
from pathlib import Path


def _finite(x) -> float:
    return 0.0 if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def accuracy_plot(rows: list[dict], path: Path, names: dict[str, str] | None, title: str) -> None:
    """Write the PNG of `accuracy_figure(rows, ...)` to `path`, atomically."""
    save_png(accuracy_figure(rows, names, title), path)


def save_png(fig, path: Path, dpi: int = 120) -> None:
    """Write a matplotlib figure to `path` as PNG, atomically (temp file, then rename), and close it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    tmp.replace(path)


def accuracy_figure(rows: list[dict], names: dict[str, str] | None, title: str):
    """The matplotlib figure of `rows` (report/evaluate summaries: label, n, overall{accuracy, ci},
    partial_credit, paper_table1_overall)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = names or {}
    labels = [f"{names.get(r['label'], r['label'])} (n={r['n']})" for r in rows][::-1]
    acc = [_finite(r["overall"]["accuracy"]) for r in rows][::-1]
    lo = [_finite(r["overall"]["ci"][0]) for r in rows][::-1]
    hi = [_finite(r["overall"]["ci"][1]) for r in rows][::-1]
    partial = [_finite(r.get("partial_credit")) for r in rows][::-1]
    paper = [r.get("paper_table1_overall") for r in rows][::-1]
    top = max([*hi, *[p for p in paper if p is not None], 1.0])
    xmax = min(100.0, max(10.0, top * 1.25))
    ys = range(len(rows))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 1.0 + 0.55 * len(rows)), sharey=True,
                                 gridspec_kw={"width_ratios": [3, 2]})
    ax.barh(ys, acc, xerr=[[a - lo_ for a, lo_ in zip(acc, lo)], [hi_ - a for a, hi_ in zip(acc, hi)]],
            color="#4C72B0", capsize=3, height=0.6)
    for y, a, h in zip(ys, acc, hi):
        ax.text(max(a, h) + xmax * 0.01, y, f"{a:.1f}%", va="center", fontsize=8)
    stars = [(p, y) for y, p in zip(ys, paper) if p is not None]
    if stars:
        ax.scatter([min(p, xmax) for p, _ in stars], [y for _, y in stars], marker="*", s=90, color="black",
                   zorder=3, label="paper Table 1 (7B, GPU)" + (" (beyond the axis: at its edge)" if top > xmax else ""))
        ax.legend(fontsize=7, loc="lower right")
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.set_xlim(0, xmax)
    ax.set_xlabel(f"accuracy % with 95% bootstrap CI (axis 0-{xmax:.0f})")
    ax.grid(axis="x", alpha=0.3)
    bx.barh(ys, partial, color="#55A868", height=0.6)
    for y, p in zip(ys, partial):
        bx.text(p + 0.01, y, f"{p:.3f}", va="center", fontsize=8)
    bx.set_xlim(0, 1.1)
    bx.set_xlabel("partial credit (mean, 0-1)")
    bx.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def probe_plot(rows: list[dict], path: Path, names: dict[str, str] | None, title: str) -> None:
    """One panel per init, one line per cell of it: the probe's mean reward at each probed step, with the
    change's 95 % paired CI in the legend (rows with `rl_probe`: `train.rl.probe.probe_summary`). Written
    atomically; an empty figure says that no run had a probe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = names or {}
    cells = [r for r in rows if r.get("rl_probe")]
    inits = sorted({r["label"].split("-", 1)[0] for r in cells}) or ["-"]
    fig, axes = plt.subplots(1, len(inits), figsize=(5 * len(inits), 3.6), sharey=True, squeeze=False)
    for ax, init in zip(axes[0], inits):
        for r in cells:
            if r["label"].split("-", 1)[0] != init:
                continue
            p, c = r["rl_probe"], r["rl_probe"]["change"]
            ax.plot(p["steps"], p["reward"], marker="o",
                    label=f"{names.get(r['label'], r['label'])}: {c['mean']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]")
        ax.set_title(f"init {init.upper()}", fontsize=9)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="end - step 0 [95% paired CI]", title_fontsize=7)
    axes[0][0].set_ylabel("probe reward (mean over prompts x samples)")
    if not cells:
        axes[0][0].text(0.5, 0.5, "no run had a probe", ha="center", transform=axes[0][0].transAxes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_png(fig, path)
