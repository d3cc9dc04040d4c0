"""Training curves from a run's `metrics.jsonl` as a PNG: `python -m jrl.plot RUN_DIR`.

Panels: loss (train, and held-out where evaluated), RL reward and accuracy (rollouts and
held-out), learning rate, gradient norm, and throughput (tokens/s); any panel without data
is left out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jrl.metrics_log import read_metrics

PANELS = (
    ("loss", ("loss", "eval_loss")),
    ("reward / accuracy", ("reward_mean", "accuracy", "eval_accuracy", "eval_accuracy_sampled")),
    ("learning rate", ("lr",)),
    ("grad norm", ("grad_norm",)),
    ("tokens / s", ("tokens_per_s",)),
)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(row["step"])
            ys.append(float(value))
    return xs, ys


def image_path(out: str | Path) -> Path:
    """The file `plot_run` writes for `out`: a name without a suffix gets `.png` (matplotlib
    would add it silently, and the path returned would not be the file written); a suffix
    matplotlib cannot write is a ValueError naming the formats it can."""
    out = Path(out)
    if not out.suffix:
        return out.with_name(out.name + ".png")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise ValueError(f"--out: {out}: matplotlib cannot write {out.suffix!r} images; "
                         f"use one of {', '.join('.' + f for f in formats)}")
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Renders `run_dir/metrics.jsonl` to `out` (default `run_dir/metrics.png`); a run that has
    logged no step yet (its config.yaml, no metrics.jsonl) gets a plot saying so. The run's
    `metrics.jsonl` itself stands for its run."""
    run_dir = Path(run_dir)
    if run_dir.name == "metrics.jsonl" and run_dir.is_file():
        run_dir = run_dir.parent
    log = run_dir / "metrics.jsonl"
    if not log.is_file() and not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{log} not found: is {run_dir} a run directory?")
    rows = read_metrics(log)
    panels = [(title, [(k, *_series(rows, k)) for k in keys]) for title, keys in PANELS]
    panels = [(t, [s for s in series if s[1]]) for t, series in panels]
    panels = [(t, series) for t, series in panels if series]
    out = image_path(out) if out is not None else run_dir / "metrics.png"
    # a Figure of its own (no pyplot): the caller's matplotlib backend is left alone;
    # imported here, as it takes a second: most processes that import jrl never plot
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 2.4 * max(len(panels), 1)))
    axes = fig.subplots(max(len(panels), 1), 1, sharex=True, squeeze=False)
    for ax, (title, series) in zip(axes[:, 0], panels):
        for key, xs, ys in series:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
    if not panels:
        axes[0, 0].text(0.5, 0.5, "no metrics yet", ha="center", va="center")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jrl plot", description="Plot a run's metrics.jsonl to a PNG.")
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl (or that metrics.jsonl)")
    parser.add_argument("--out", help="output image (default RUN_DIR/metrics.png; a name without a suffix gets .png, "
                        "another suffix picks the format: .svg, .pdf, ...)")
    args = parser.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.out)
    except (OSError, ValueError) as e:  # no metrics.jsonl, a corrupt row, an --out that cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
