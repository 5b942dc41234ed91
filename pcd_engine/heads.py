"""Heads: a per-field linear classifier on the model's own features, fitted on the user's labels.

    logits = (scale * z + bias + W @ standardised(x)) / temperature -> softmax

`z` are the rule's log-scores of the field's values (what the model knows of the labels' meaning,
useful from zero labels); `x` is one block of hidden states from the same forward call
(`hidden.py`): the field's fork state, or the text's mean state at the final or the middle layer.
With W = 0 the head is the `bias` calibration map; the L2 penalty on W pulls it there, and the bias
is pulled toward the label-free (batch) estimate, more strongly for a value with few labels.

`fit_heads` chooses, per field, the block and the L2 strength by cross-validated log-loss over the
folds (an `L2Path`), then fits a temperature on the chosen configuration's out-of-fold logits over
finer folds (heads fitted on nearly every row, as the final head is: a temperature fitted on heads
that saw 4/5 of the rows left the final head underconfident); each row's reported probabilities
come from a head fitted without that row. Every fit of one strength, over the blocks, the folds
and the fields, is one batch of `optimisers.fit_linears` (`run_paths`): a head's cost is a few
dozen batched steps per strength, not hundreds of small fits one after another.

    >>> fitted = fit_head(values, z, features, labels, fold, tree)  # doctest: +SKIP
    >>> fitted.head.apply(field_result, hidden_states)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pcd_engine.hidden import BLOCKS, HiddenStates
from pcd_engine.optimisers import (
    Linear,
    LinearProblem,
    batch_prior,
    fit_linear,
    fit_linears,
    fit_temperature,
    standardiser,
)
from pcd_engine.results import FieldResult

HEAD_MIN_LABELS = 2  # see head_ready
L2_GRID = (1.0, 0.1, 0.01, 0.001)  # penalty on W (mean cross-entropy + l2 * sum(W**2)), tried in turn


@dataclass(frozen=True, eq=False)
class FieldHead:
    """One field's fitted head (see the module). `tree` is the field's tree index in the plan (where
    its fork state is); `block` names the hidden-state block it reads."""

    values: tuple[str, ...]
    block: str
    tree: int
    scale: float
    bias: tuple[float, ...]
    weight: torch.Tensor  # (values, D)
    mean: torch.Tensor  # (D,) feature means of the fitting rows
    std: torch.Tensor  # (D,) and standard deviations (at least 1e-6)
    temperature: float = 1.0
    l2: float = 0.0
    method: str = "head"

    def logits(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Calibrated logits for rows of log-scores (..., K) and features (..., D)."""
        out = z.double() * self.scale + torch.tensor(self.bias, dtype=torch.float64)
        out = out + ((x.double() - self.mean) / self.std) @ self.weight.T
        return out / self.temperature

    def features(self, hidden: HiddenStates) -> torch.Tensor:
        return hidden.block(self.block, self.tree)

    def apply(self, result: FieldResult, hidden: HiddenStates | None = None) -> FieldResult:
        if result.source != "scored" or result.rule == "fixed":
            return result
        if hidden is None:
            raise ValueError(f"field {result.path!r} has a head but the request kept no hidden states")
        z = torch.tensor(list(result.log_scores.values()), dtype=torch.float64)
        return with_logits(result, self.logits(z, self.features(hidden).double()), "head")

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": self.weight, f"{prefix}.mean": self.mean, f"{prefix}.std": self.std}

    def to_json(self) -> dict[str, Any]:
        return {
            "method": "head",
            "values": list(self.values),
            "block": self.block,
            "tree": self.tree,
            "scale": self.scale,
            "bias": list(self.bias),
            "temperature": self.temperature,
            "l2": self.l2,
        }

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], prefix: str
    ) -> FieldHead:
        if data["block"] not in BLOCKS:
            raise ValueError(f"unknown feature block {data['block']!r}")
        weight, mean, std = (tensors[f"{prefix}.{name}"].double() for name in ("weight", "mean", "std"))
        if weight.shape != (len(data["values"]), mean.shape[0]) or std.shape != mean.shape:
            raise ValueError(f"the weights of field {prefix!r} do not fit its values")
        return cls(
            tuple(data["values"]),
            data["block"],
            int(data["tree"]),
            float(data["scale"]),
            tuple(float(b) for b in data["bias"]),
            weight,
            mean,
            std,
            float(data["temperature"]),
            float(data["l2"]),
        )


def with_logits(result: FieldResult, logits: torch.Tensor, method: str) -> FieldResult:
    """`result` answered by the softmax of calibrated logits (one per value, in its order). A
    shortlisted field's values outside its shortlist are estimates: none is put above the lowest
    shortlisted value, so the answer stays one of the values scored exactly (shortlist.py)."""
    if result.shortlist is not None:
        values = list(result.log_scores)
        exact = torch.tensor([values.index(v) for v in result.shortlist])
        outside = torch.ones(len(values), dtype=torch.bool)
        outside[exact] = False
        logits = torch.where(outside, torch.clamp(logits, max=float(logits[exact].min())), logits)
    return with_probabilities(result, torch.softmax(logits, dim=0).tolist(), method)


def with_probabilities(result: FieldResult, probs: Sequence[float], method: str) -> FieldResult:
    """`result` answered by new probabilities (one per value, in its order)."""
    values = list(result.log_scores)
    chosen = max(range(len(probs)), key=probs.__getitem__)
    runner_up = max((p for i, p in enumerate(probs) if i != chosen), default=0.0)
    return dataclasses.replace(
        result,
        value=values[chosen],
        probabilities=dict(zip(values, probs, strict=True)),
        margin=probs[chosen] - runner_up,
        calibrated=method != "none",
        calibration=method,
    )


@dataclass(frozen=True)
class Basis:
    """The standardised features of a head's fitting rows, in an orthonormal basis holding their
    span. A head's loss sees W only through `W @ x` of those rows and its L2 penalty is on every
    weight, so the fitted W lies in their span: fitted in this basis (at most one weight per row
    and value instead of one per hidden dimension, 576 for SmolLM2, 2304 for MiniCPM5-2B), it is
    the same head. `rows` are the fitting rows in it."""

    mean: torch.Tensor  # (D,)
    std: torch.Tensor  # (D,)
    directions: torch.Tensor  # (D, r) orthonormal columns, r <= min(rows, D)
    rows: torch.Tensor  # (rows, r)

    @classmethod
    def of(cls, x: torch.Tensor) -> Basis:
        x = x.double()
        mean, std = standardiser(x)
        # QR of the rows as columns: xs^T = Q R, so Q's columns hold every row and xs @ Q = R^T
        directions, r = torch.linalg.qr(((x - mean) / std).T)
        return cls(mean, std, directions, r.T)

    def standardised(self, x: torch.Tensor) -> torch.Tensor:
        return (x.double() - self.mean) / self.std

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.standardised(x) @ self.directions

    def start(self, fitted: Linear) -> Linear:
        """A warm start in this basis from a fit on other (for example all) rows, its weights over
        the standardised features."""
        assert fitted.weight is not None
        return dataclasses.replace(fitted, weight=fitted.weight @ self.directions)

    def fit(
        self, z: torch.Tensor, x: torch.Tensor, labels: torch.Tensor, l2: float, start: Linear | None = None
    ) -> Linear:
        """`fit_linear` on rows already `project`ed; its weights back over the standardised features."""
        fitted = fit_linear(z, labels, batch_prior(z), x, l2, self.start(start) if start else None)
        assert fitted.weight is not None
        return dataclasses.replace(fitted, weight=fitted.weight @ self.directions.T)

    def head(self, values: tuple[str, ...], block: str, tree: int, fitted: Linear, l2: float) -> FieldHead:
        """The head, owning its tensors: fields that share this basis (`Bases`) get copies of its
        mean and std (a saved calibration's tensors may not share memory)."""
        assert fitted.weight is not None
        bias = tuple(fitted.bias.tolist())
        mean, std = self.mean.clone(), self.std.clone()
        return FieldHead(values, block, tree, fitted.scale, bias, fitted.weight, mean, std, 1.0, l2)


class Bases:
    """`Basis.of`, once per distinct matrix. Every field of a schema reads the same text blocks
    (`text_last`, `text_middle`) of the same rows, cut in the same folds, so without this their
    bases (a QR each) were computed once per field. Matrices are matched by shape and sum, then
    compared whole: an equal matrix gets the very same basis, so answers are unchanged."""

    def __init__(self) -> None:
        self._seen: dict[tuple[tuple[int, ...], float], list[tuple[torch.Tensor, Basis]]] = {}

    def of(self, x: torch.Tensor) -> Basis:
        x = x.double()
        same = self._seen.setdefault((tuple(x.shape), float(x.sum())), [])
        for seen, basis in same:
            if torch.equal(seen, x):
                return basis
        basis = Basis.of(x)
        same.append((x, basis))
        return basis


def fit_config(
    values: tuple[str, ...],
    z: torch.Tensor,
    x: torch.Tensor,
    labels: torch.Tensor,
    block: str,
    tree: int,
    l2: float,
) -> FieldHead:
    """One head on these rows (temperature 1)."""
    basis = Basis.of(x)
    return basis.head(values, block, tree, basis.fit(z, basis.rows, labels, l2), l2)


class L2Path:
    """One field's L2 path: per feature block and L2 strength of `grid`, each row's logits from a
    head fitted on the other folds only (`logits`), and the head fitted on every row (`every`, its
    weights over the standardised features of `bases[block]`, the basis of every row), keyed by
    (block, strength) in the order tried per block. The strengths go from the strongest penalty
    down, each fit starting where its own fit at the strength before stopped (the first from
    `start`, a fit on every row, if given). With `stop_rising`, a block's path ends at the first
    strength whose cross-validated log-loss is above the one before it. `bases`, shared with other
    paths, computes each distinct matrix's basis once. `run_paths` fits it."""

    def __init__(
        self,
        z: torch.Tensor,
        features: Mapping[str, torch.Tensor],
        labels: torch.Tensor,
        fold: Sequence[int],
        grid: Sequence[float],
        start: Linear | None = None,
        stop_rising: bool = False,
        bases: Bases | None = None,
    ) -> None:
        self.z, self.features, self.labels, self.stop_rising = z, features, labels, stop_rising
        tags = torch.tensor(fold)
        self.tests = [tags == k for k in sorted(set(fold))]
        self.subsets = [torch.ones_like(tags, dtype=torch.bool)] + [~t for t in self.tests]
        bases = bases or Bases()
        self.bases = {block: bases.of(x) for block, x in features.items()}
        self.parts = {block: [bases.of(x[~test]) for test in self.tests] for block, x in features.items()}
        self.rows = {block: [b.rows for b in self.bases_of(block)] for block in features}  # all, complements
        self.warm: dict[str, Sequence[Linear | None]] = {
            block: [basis.start(start) if start else None for basis in self.bases_of(block)]
            for block in features
        }
        self.strengths = sorted(grid, reverse=True)
        self.live, self.last = list(features), dict.fromkeys(features, math.inf)
        self.logits: dict[tuple[str, float], torch.Tensor] = {}
        self.every: dict[tuple[str, float], Linear] = {}

    def bases_of(self, block: str) -> list[Basis]:
        return [self.bases[block], *self.parts[block]]

    def problems(self, step: int) -> list[LinearProblem]:
        """The fits of the `step`-th strength: per live block, on every row and on each complement."""
        if step >= len(self.strengths):
            return []
        z, labels, l2 = self.z, self.labels, self.strengths[step]
        return [
            LinearProblem(z[rows], labels[rows], batch_prior(z[rows]), x, l2, self.warm[block][i])
            for block in self.live
            for i, (rows, x) in enumerate(zip(self.subsets, self.rows[block], strict=True))
        ]

    def take(self, step: int, fitted: Sequence[Linear]) -> None:
        """Record the `step`-th strength's fits (in `problems`' order)."""
        l2, answers = self.strengths[step], iter(fitted)
        for block in list(self.live):
            every, *folds = fits = [next(answers) for _ in self.subsets]
            self.warm[block] = fits
            assert every.weight is not None
            self.every[block, l2] = dataclasses.replace(
                every, weight=every.weight @ self.bases[block].directions.T
            )
            logits = torch.empty_like(self.z, dtype=torch.float64)
            for test, basis, f in zip(self.tests, self.parts[block], folds, strict=True):
                assert f.weight is not None
                x_test = basis.project(self.features[block][test])
                logits[test] = self.z[test].double() * f.scale + f.bias + x_test @ f.weight.T
            self.logits[block, l2] = logits
            loss = float(torch.nn.functional.cross_entropy(logits, self.labels))
            if self.stop_rising and loss > self.last[block]:
                self.live.remove(block)
            self.last[block] = loss


def run_paths(paths: Sequence[L2Path]) -> None:
    """Fit several fields' paths in step: each strength's fits of every path are one `fit_linears`
    call, so fields with the same number of values share their batched steps."""
    for step in range(max((len(p.strengths) for p in paths), default=0)):
        asked = [p.problems(step) for p in paths]
        fitted = iter(fit_linears([q for problems in asked for q in problems]))
        for path, problems in zip(paths, asked, strict=True):
            if problems:
                path.take(step, [next(fitted) for _ in problems])


@dataclass(frozen=True)
class HeadTask:
    """One field's rows for `fit_heads`: its values, tree, log-scores (n, K), features per block,
    labels, folds, and the finer folds its temperature is fitted over (None: `fold`)."""

    values: tuple[str, ...]
    tree: int
    z: torch.Tensor
    features: Mapping[str, torch.Tensor]
    labels: torch.Tensor
    fold: Sequence[int]
    temperature_fold: Sequence[int] | None = None


@dataclass(frozen=True)
class HeadFit:
    head: FieldHead  # fitted on every row, with the out-of-fold temperature
    out_of_fold: torch.Tensor  # (rows, K) probabilities, each from a head fitted without its row
    tried: dict[str, float]  # "block/l2" -> cross-validated log-loss
    compared: torch.Tensor  # the same over `fold` (what other methods' out-of-fold figures are over)


def fit_head(
    values: tuple[str, ...],
    z: torch.Tensor,
    features: Mapping[str, torch.Tensor],
    labels: torch.Tensor,
    fold: Sequence[int],
    tree: int,
    temperature_fold: Sequence[int] | None = None,
) -> HeadFit:
    """`fit_heads` for one field."""
    return fit_heads([HeadTask(values, tree, z, features, labels, fold, temperature_fold)])[0]


def fit_heads(tasks: Sequence[HeadTask]) -> list[HeadFit]:
    """Per field: choose the feature block and L2 strength by out-of-fold log-loss over `fold`, fit
    a temperature on the chosen configuration's out-of-fold logits over `temperature_fold` (finer
    folds: heads fitted on nearly every row, as the final head is); the head is the chosen
    configuration's fit on every row. The fields' paths are fitted together (`run_paths`)."""
    if any(not t.features for t in tasks):
        raise ValueError("fit_heads needs at least one feature block per field")
    features = [{block: x.double() for block, x in t.features.items()} for t in tasks]
    bases = Bases()  # shared by the fields: their text blocks are the same rows
    coarse = [
        L2Path(t.z, f, t.labels, t.fold, L2_GRID, stop_rising=True, bases=bases)
        for t, f in zip(tasks, features, strict=True)
    ]
    run_paths(coarse)
    chosen, fine = [], {}
    for i, (task, path) in enumerate(zip(tasks, coarse, strict=True)):
        losses = {
            key: float(torch.nn.functional.cross_entropy(p, task.labels)) for key, p in path.logits.items()
        }
        order = sorted(losses, key=lambda key: list(features[i]).index(key[0]))  # blocks in turn
        block, l2 = min(order, key=losses.__getitem__)  # ties: the first block, the strongest L2
        chosen.append((block, l2, {f"{b}/{strength:g}": losses[b, strength] for b, strength in order}))
        if task.temperature_fold is not None and list(task.temperature_fold) != list(task.fold):
            x = {block: features[i][block]}
            fine[i] = L2Path(
                task.z, x, task.labels, task.temperature_fold, (l2,), path.every[block, l2], bases=bases
            )
    run_paths(list(fine.values()))
    out = []
    for i, (task, path, (block, l2, tried)) in enumerate(zip(tasks, coarse, chosen, strict=True)):
        logits = path.logits[block, l2]
        temperature = fit_temperature(logits, task.labels)
        compared = torch.softmax(logits / temperature, dim=1)
        head = path.bases[block].head(task.values, block, task.tree, path.every[block, l2], l2)
        if i in fine:
            logits = fine[i].logits[block, l2]
            temperature = fit_temperature(logits, task.labels)
        head = dataclasses.replace(head, temperature=temperature)
        out.append(HeadFit(head, torch.softmax(logits / temperature, dim=1), tried, compared))
    return out


def head_ready(labels: Sequence[int], values: int) -> bool:
    """Whether a head can be fitted: 2 values or more labeled HEAD_MIN_LABELS times or more, and
    those values hold at least half of the labels (a value labeled once or never is answered
    through the rule's scores and its bias; a 77-value field needs no 154 labels)."""
    counts = Counter(labels)
    often = [c for c in counts.values() if c >= HEAD_MIN_LABELS]
    return len(often) >= 2 and 2 * sum(often) >= len(labels)


def not_ready(values: tuple[str, ...], labels: Sequence[int]) -> str:
    counts = dict(Counter(values[i] for i in labels))
    return (
        f"a head needs 2 values labeled {HEAD_MIN_LABELS} times or more, holding half of the labels "
        f"({counts})"
    )
