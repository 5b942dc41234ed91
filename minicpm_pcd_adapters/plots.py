"""PNG plots of an evaluation (matplotlib, files only): a reliability diagram and coverage-accuracy
curves, one line or bar set per scored field; the coverage curves mark where `--abstain-below`
0.5, 0.7 and 0.9 would put each field and its majority-answer floor. `field_plots` draws the same two
for one field with its variants (uncalibrated, calibrated) overlaid, as PNG bytes for `report.html`."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files, no display
import matplotlib.pyplot as plt

from pcd_engine import Evaluation


def reliability_diagram(evaluation: Evaluation, path: Path, title: str = "") -> Path:
    """Per field, accuracy against mean confidence in each confidence bin (the diagonal is perfect
    calibration); a marker's area is its bin's count. Below 100 answers a field's bins are noisy,
    and the plot says so."""
    fig, ax = plt.subplots(figsize=(6, 6))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
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
    xlabel = "confidence (marker area: the bin's count)"
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel=xlabel, ylabel="accuracy", title=title or "reliability")
    ax.legend(fontsize=7, loc="upper left")
    _small_sample_note(ax, evaluation)
    return _save(fig, path)


def coverage_plot(evaluation: Evaluation, path: Path, title: str = "") -> Path:
    """Per field, accuracy on the answered inputs against the share answered, abstaining below each
    confidence threshold."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, f in evaluation.fields.items():
        report = f.report()
        curve = report.get("coverage_accuracy", [])
        if not curve:
            continue
        (line,) = ax.plot([p["coverage"] for p in curve], [p["accuracy"] for p in curve], label=name)
        color = line.get_color()
        ax.axhline(report["majority"], color=color, linestyle=":", linewidth=1)  # always the top label
        _mark_thresholds(ax, curve, color)
    ax.plot([], [], color="grey", linestyle=":", label="majority answer (dotted)")
    ax.plot([], [], color="grey", marker="o", linestyle="", label="--abstain-below 0.5 / 0.7 / 0.9")
    ax.set(xlim=(0, 1), ylim=(0, 1.02), xlabel="coverage (share answered)", ylabel="accuracy on answered")
    ax.set_title(title or "coverage vs accuracy (abstaining below a confidence)")
    ax.legend(fontsize=7, loc="lower left")
    _small_sample_note(ax, evaluation)
    return _save(fig, path)


THRESHOLDS = (0.5, 0.7, 0.9)


def field_plots(name: str, reports: Mapping[str, Mapping[str, Any]]) -> tuple[bytes, bytes]:
    """PNG bytes of one field's reliability diagram and coverage curve, a line per variant (its
    `FieldEvaluation.report()`): each bin's count written beside its marker, the thresholds of
    `--abstain-below` and the majority-answer floor marked."""
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
    for variant, report in reports.items():
        bins = report.get("reliability", [])
        if not bins:
            continue
        x, y = [b["confidence"] for b in bins], [b["accuracy"] for b in bins]
        (line,) = ax.plot(x, y, marker="o", linewidth=1, label=f"{variant} (ECE {report['ece']:.3f})")
        for b in bins:
            ax.annotate(str(b["count"]), (b["confidence"], b["accuracy"]), fontsize=6,
                        xytext=(3, -8), textcoords="offset points", color=line.get_color())  # fmt: skip
    ax.set(xlim=(0, 1), ylim=(0, 1.02), xlabel="confidence (numbers: answers in the bin)", ylabel="accuracy")
    ax.set_title(f"{name}: reliability", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    reliability = _png(fig)
    fig, ax = plt.subplots(figsize=(5, 4))
    for variant, report in reports.items():
        curve = report.get("coverage_accuracy", [])
        if not curve:
            continue
        (line,) = ax.plot([p["coverage"] for p in curve], [p["accuracy"] for p in curve], label=variant)
        _mark_thresholds(ax, curve, line.get_color())
    majority = next((r["majority"] for r in reports.values() if "majority" in r), None)
    if majority is not None:
        ax.axhline(
            majority, color="grey", linestyle=":", linewidth=1, label=f"majority answer ({majority:.2f})"
        )
    ax.plot([], [], color="grey", marker="o", linestyle="", label="--abstain-below 0.5 / 0.7 / 0.9")
    ax.set(xlim=(0, 1), ylim=(0, 1.02), xlabel="coverage (share answered)", ylabel="accuracy on answered")
    ax.set_title(f"{name}: coverage vs accuracy", fontsize=10)
    ax.legend(fontsize=7, loc="lower left")
    return reliability, _png(fig)


def _mark_thresholds(ax: plt.Axes, curve: list[dict[str, float]], color: Any) -> None:
    """Where `--abstain-below` 0.5 / 0.7 / 0.9 puts a coverage curve."""
    for threshold in THRESHOLDS:
        kept = [p for p in curve if p["threshold"] >= threshold]
        if kept:
            point = max(kept, key=lambda p: p["coverage"])
            ax.plot(point["coverage"], point["accuracy"], marker="o", color=color, markersize=4)
            ax.annotate(f"{threshold:g}", (point["coverage"], point["accuracy"]), fontsize=6,
                        xytext=(3, 3), textcoords="offset points", color=color)  # fmt: skip


def _png(fig: plt.Figure) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def _small_sample_note(ax: plt.Axes, evaluation: Evaluation) -> None:
    """A warning on the plot when a field has fewer than 100 scored answers."""
    smallest = min((f.report()["n"] for f in evaluation.fields.values()), default=0)
    if 0 < smallest < 100:
        ax.text(0.98, 0.02, f"only {smallest} answers: noisy", transform=ax.transAxes, ha="right",
                va="bottom", fontsize=7, color="firebrick")  # fmt: skip


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
