"""How good are a field's answers and probabilities: accuracy, macro-F1, ECE, log-loss and curves.

Every function reads the same two things for one field: `probabilities`, one row per input holding the
probability of each allowed value (in a fixed value order), and `labels`, the index of the true value
per input. The answer is the most probable value.

    >>> field_report([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]], [0, 1, 1])["accuracy"]
    0.6666666666666666
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

Rows = Sequence[Sequence[float]]
ECE_BINS = 10
FIGURES = ("accuracy", "macro_f1", "ece", "log_loss")  # what field_report gives besides the count


def predictions(probabilities: Rows) -> list[int]:
    return [max(range(len(row)), key=row.__getitem__) for row in probabilities]


def confidences(probabilities: Rows) -> list[float]:
    return [max(row) for row in probabilities]


def accuracy(probabilities: Rows, labels: Sequence[int]) -> float:
    hits = sum(p == y for p, y in zip(predictions(probabilities), labels, strict=True))
    return hits / len(labels)


def macro_f1(probabilities: Rows, labels: Sequence[int]) -> float:
    """Mean F1 over the values that occur as a label or as an answer (a value never seen nor
    predicted does not count)."""
    predicted = predictions(probabilities)
    scores = []
    for value in sorted(set(labels) | set(predicted)):
        tp = sum(p == value and y == value for p, y in zip(predicted, labels, strict=True))
        fp = sum(p == value and y != value for p, y in zip(predicted, labels, strict=True))
        fn = sum(p != value and y == value for p, y in zip(predicted, labels, strict=True))
        scores.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return sum(scores) / len(scores)


def log_loss(probabilities: Rows, labels: Sequence[int], floor: float = 1e-12) -> float:
    """Mean negative log-probability of the true value."""
    return -sum(math.log(max(row[y], floor)) for row, y in zip(probabilities, labels, strict=True)) / len(
        labels
    )


def reliability(probabilities: Rows, labels: Sequence[int], bins: int = ECE_BINS) -> list[dict[str, float]]:
    """Equal-width confidence bins: per non-empty bin, its count, mean confidence and accuracy."""
    buckets: list[list[tuple[float, bool]]] = [[] for _ in range(bins)]
    for conf, p, y in zip(confidences(probabilities), predictions(probabilities), labels, strict=True):
        buckets[min(int(conf * bins), bins - 1)].append((conf, p == y))
    return [
        {
            "low": i / bins,
            "high": (i + 1) / bins,
            "count": len(b),
            "confidence": sum(c for c, _ in b) / len(b),
            "accuracy": sum(ok for _, ok in b) / len(b),
        }
        for i, b in enumerate(buckets)
        if b
    ]


def ece(probabilities: Rows, labels: Sequence[int], bins: int = ECE_BINS) -> float:
    """Expected calibration error: the count-weighted mean |accuracy - confidence| over the bins."""
    total = len(labels)
    return sum(
        b["count"] / total * abs(b["accuracy"] - b["confidence"])
        for b in reliability(probabilities, labels, bins)
    )


def coverage_accuracy(probabilities: Rows, labels: Sequence[int]) -> list[dict[str, float]]:
    """Abstaining below each observed confidence: per threshold, the share of inputs answered and
    the accuracy on them (the first point answers every input)."""
    hits_per_input = [p == y for p, y in zip(predictions(probabilities), labels, strict=True)]
    pairs = sorted(zip(confidences(probabilities), hits_per_input, strict=True), key=lambda pair: -pair[0])
    points, hits = [], 0
    for answered, (conf, ok) in enumerate(pairs, start=1):
        hits += ok
        if answered == len(pairs) or pairs[answered][0] < conf:
            points.append({"threshold": conf, "coverage": answered / len(pairs), "accuracy": hits / answered})
    return points[::-1]


def majority_floor(train_labels: Sequence[int], labels: Sequence[int]) -> float:
    """Accuracy of always answering the most frequent value of `train_labels`."""
    most = Counter(train_labels).most_common(1)[0][0]
    return sum(y == most for y in labels) / len(labels)


def confusion(probabilities: Rows, labels: Sequence[int], size: int) -> list[list[int]]:
    """counts[true][answered]."""
    counts = [[0] * size for _ in range(size)]
    for p, y in zip(predictions(probabilities), labels, strict=True):
        counts[y][p] += 1
    return counts


def field_report(probabilities: Rows, labels: Sequence[int]) -> dict[str, Any]:
    """The figures reported for one field (and the count they come from)."""
    return {
        "n": len(labels),
        "accuracy": accuracy(probabilities, labels),
        "macro_f1": macro_f1(probabilities, labels),
        "ece": ece(probabilities, labels),
        "log_loss": log_loss(probabilities, labels),
    }
