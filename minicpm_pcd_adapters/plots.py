"""PNG plots of an evaluation (matplotlib, files only): a reliability diagram and coverage-accuracy
curves, one line or bar set per scored field."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files, no display
import matplotlib.pyplot as plt

from pcd_engine import Evaluation


def reliability_diagram(evaluation: Evaluation, path: Path, title: str = "") -> Path:
    """Per field, accuracy against mean confidence in each confidence bin (the diagonal is perfect
    calibration); marker size grows with the bin's count."""
    fig, ax = plt.subplots(figsize=(6, 6))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="calibrated")
    for name, f in evaluation.fields.items():
        report = f.report()
        bins = report.get("reliability", [])
        if not bins:
            continue
        sizes = [10 + 200 * b["count"] / report["n"] for b in bins]
        (line,) = ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], linewidth=1)
        ax.scatter(
            [b["confidence"] for b in bins],
            [b["accuracy"] for b in bins],
            s=sizes,
            color=line.get_color(),
            label=f"{name} (ECE {report['ece']:.3f})",
        )
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", ylabel="accuracy", title=title or "reliability")
    ax.legend(fontsize=7, loc="upper left")
    return _save(fig, path)


def coverage_plot(evaluation: Evaluation, path: Path, title: str = "") -> Path:
    """Per field, accuracy on the answered inputs against the share answered, abstaining below each
    confidence threshold."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, f in evaluation.fields.items():
        curve = f.report().get("coverage_accuracy", [])
        if curve:
            ax.plot([p["coverage"] for p in curve], [p["accuracy"] for p in curve], label=name)
    ax.set(xlim=(0, 1), ylim=(0, 1.02), xlabel="coverage (share answered)", ylabel="accuracy on answered")
    ax.set_title(title or "coverage vs accuracy (abstaining below a confidence)")
    ax.legend(fontsize=7, loc="lower left")
    return _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
