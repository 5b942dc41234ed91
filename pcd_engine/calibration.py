"""Calibration: per field, a map from the rule's scores to probabilities that match how often it is right.

    the rule's log-scores z (one per allowed value, prior already subtracted)
        -> z / temperature + bias -> softmax -> calibrated probabilities (the answer is their argmax)

A `Calibration` holds one map per scored field (fitted by `fitting.py` from the user's texts), or a
head (`heads.py`: a linear classifier that also reads the model's hidden states), what it was fitted
for (the plan's fingerprint, the model's identity, each field's rule) and its cross-validated report;
it refuses to be applied to anything else. `save`/`load` write it as JSON, and the heads' weights as
safetensors beside it (`NAME.safetensors`, its SHA-256 recorded in the JSON). `abstain` marks the
fields whose confidence is below a threshold.

    >>> cal = engine.calibrate(Ticket, texts, labels)  # doctest: +SKIP
    >>> cal.report["fields"]["topic"]["after"]["accuracy"]  # doctest: +SKIP
    >>> engine.classify(text, Ticket, calibration=cal)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from pcd_engine.errors import CalibrationError
from pcd_engine.heads import FieldHead, with_logits
from pcd_engine.hidden import HiddenStates
from pcd_engine.packed_weights import dense_weight
from pcd_engine.plan import SchemaPlan
from pcd_engine.results import FieldResult

FORMAT = "pcd-calibration/1"


@dataclass(frozen=True)
class FieldCalibration:
    """One field's map: probabilities = softmax(log_scores / temperature + bias)."""

    method: str
    values: tuple[str, ...]  # json_key of each allowed value, in the field's candidate order
    temperature: float = 1.0
    bias: tuple[float, ...] = ()  # one per value; empty: no bias

    def logits(self, log_scores: torch.Tensor) -> torch.Tensor:
        """Calibrated logits for rows of log-scores (shape (..., len(values)))."""
        out = log_scores.double() / self.temperature
        return out + torch.tensor(self.bias, dtype=torch.float64) if self.bias else out

    def apply(self, result: FieldResult, hidden: HiddenStates | None = None) -> FieldResult:
        if result.source != "scored" or result.rule == "fixed":
            return result
        return with_logits(result, self.logits(torch.tensor(list(result.log_scores.values()))), self.method)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FieldMap = FieldCalibration | FieldHead


@dataclass(frozen=True)
class ModelIdentity:
    """Which weights scores came from. `config` hashes the model's configuration (paths, dtype and
    versions left out); `probe` holds the norms of slices of a few weight tensors, compared with a
    1% tolerance so that the same weights in another dtype or device still match. `precision` is
    how the scores were computed (`float32`, `bfloat16`, `bfloat16, fp32 re-scoring below 0.2`):
    the same weights in another precision move scores and decisions, so a calibration is refused
    there (files from before it was recorded were fitted in float32)."""

    name: str
    config: str
    probe: tuple[float, ...]
    precision: str = "float32"

    def matches(self, other: ModelIdentity) -> bool:
        return (
            self.config == other.config
            and len(self.probe) == len(other.probe)
            and all(
                math.isclose(a, b, rel_tol=1e-2, abs_tol=1e-6)
                for a, b in zip(self.probe, other.probe, strict=True)
            )
        )


def model_identity(
    model: Any, precision: str | None = None, probes: int = 8, width: int = 4096
) -> ModelIdentity:
    """`precision` defaults to the dtype of the model's weights."""
    config = getattr(model, "config", None)
    data = config.to_dict() if config is not None else {}
    skip = {"_name_or_path", "name_or_path", "torch_dtype", "dtype", "transformers_version", "_commit_hash"}
    text = json.dumps({k: v for k, v in data.items() if k not in skip}, sort_keys=True, default=str)
    params = [p for _, p in model.named_parameters()]
    picked = [
        params[round(i * (len(params) - 1) / max(probes - 1, 1))] for i in range(min(probes, len(params)))
    ]
    with torch.no_grad():
        probe = tuple(float(dense_weight(p.detach()).reshape(-1)[:width].float().norm()) for p in picked)
    name = str(data.get("_name_or_path") or type(model).__name__)
    if precision is None:
        precision = str(next(model.parameters()).dtype).removeprefix("torch.")
    return ModelIdentity(name, hashlib.sha256(text.encode()).hexdigest(), probe, precision)


@dataclass(frozen=True)
class Calibration:
    """Fitted field maps plus what they were fitted for, and the cross-validated report."""

    fields: Mapping[str, FieldMap]
    schema: str  # SchemaPlan.fingerprint: fields, values and the whole prompt head text
    model: ModelIdentity
    rules: Mapping[str, str]  # the rule name each field was scored with
    report: Mapping[str, Any] = field(default_factory=dict)
    held_out: Mapping[str, HeldOut] = field(default_factory=dict, compare=False)  # not saved

    def check(self, plan: SchemaPlan, model: ModelIdentity) -> None:
        """CalibrationError unless this calibration was fitted for `plan` on `model`."""
        if plan.fingerprint != self.schema:
            raise CalibrationError(
                "this calibration was fitted for another schema or prompt (its fields, values, "
                "descriptions, instructions or examples differ); fit one for this schema"
            )
        if not self.model.matches(model):
            raise CalibrationError(
                f"this calibration was fitted on model {self.model.name!r}, not on {model.name!r} "
                "(its configuration or weights differ); fit one on this model"
            )
        if self.model.precision != model.precision:
            raise CalibrationError(
                f"this calibration was fitted on scores computed in {self.model.precision}, and this "
                f"engine computes them in {model.precision}; fit one with this engine"
            )
        rules = plan_rules(plan)
        if rules != dict(self.rules):
            wrong = sorted(p for p in rules if rules[p] != self.rules.get(p))
            raise CalibrationError(
                f"field {wrong[0]!r} is scored with rule {rules[wrong[0]]!r}, but the calibration was "
                f"fitted with {self.rules.get(wrong[0])!r}; use the same rule"
            )

    @property
    def needs_hidden(self) -> bool:
        """Whether some field has a head, which reads hidden states kept by the scoring pass."""
        return any(isinstance(f, FieldHead) for f in self.fields.values())

    def apply(
        self, fields: Mapping[str, FieldResult], hidden: HiddenStates | None = None
    ) -> dict[str, FieldResult]:
        return apply_all(self.fields, fields, hidden)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "schema": self.schema,
            "model": dataclasses.asdict(self.model),
            "rules": dict(self.rules),
            "fields": {path: f.to_json() for path, f in self.fields.items()},
            "report": self.report,
        }

    def save(self, path: str | Path) -> None:
        """Write the JSON to `path`; with heads, their weights to `path` with suffix .safetensors."""
        path = Path(path)
        data = self.to_json()
        heads = {p: f for p, f in self.fields.items() if isinstance(f, FieldHead)}
        if heads:
            tensors = {k: t.contiguous() for p, h in heads.items() for k, t in h.tensors(p).items()}
            blob = save_tensors(tensors, metadata={"format": FORMAT, "schema": self.schema})
            weights = weights_path(path)
            weights.write_bytes(blob)
            data["weights"] = {"file": weights.name, "sha256": hashlib.sha256(blob).hexdigest()}
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r} is not {FORMAT!r}")
            tensors = _load_weights(Path(path), data.get("weights"))
            fields: dict[str, FieldMap] = {}
            for p, f in data["fields"].items():
                if f["method"] == "head":
                    fields[p] = FieldHead.from_json(f, tensors, p)
                else:
                    fields[p] = FieldCalibration(
                        f["method"], tuple(f["values"]), float(f["temperature"]), tuple(f["bias"])
                    )
            model = data["model"]
            precision = model.get("precision", "float32")
            identity = ModelIdentity(model["name"], model["config"], tuple(model["probe"]), precision)
            return cls(fields, data["schema"], identity, data["rules"], data.get("report", {}))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CalibrationError(f"cannot load a calibration from {path}: {error}") from None


def weights_path(path: Path) -> Path:
    """Where a calibration saved at `path` keeps its heads' weights."""
    return path.with_suffix(".safetensors")


def _load_weights(path: Path, weights: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
    if weights is None:
        return {}
    file = path.parent / weights["file"]
    try:
        blob = file.read_bytes()
    except OSError:
        raise ValueError(f"its head weights {file} are missing (they are saved beside the JSON)") from None
    if hashlib.sha256(blob).hexdigest() != weights["sha256"]:
        raise ValueError(f"its head weights {file} are not the ones it was saved with (SHA-256 differs)")
    return load_tensors(blob)


def plan_rules(plan: SchemaPlan) -> dict[str, str]:
    return {dp.decision.path: dp.rule_name for dp in plan.scored_decisions}


def apply_all(
    calibrations: Mapping[str, FieldMap],
    fields: Mapping[str, FieldResult],
    hidden: HiddenStates | None = None,
) -> dict[str, FieldResult]:
    return {p: calibrations[p].apply(f, hidden) if p in calibrations else f for p, f in fields.items()}


def abstain(fields: Mapping[str, FieldResult], below: float) -> dict[str, FieldResult]:
    """Mark every scored field whose confidence is below `below` as abstained (its value stays the
    best guess, for review)."""
    out = {}
    for path, f in fields.items():
        confidence = f.confidence
        unsure = confidence is not None and f.rule != "fixed" and confidence < below
        out[path] = dataclasses.replace(f, abstained=True) if unsure else f
    return out


@dataclass(frozen=True)
class HeldOut:
    """One field's labeled rows after fitting: true value indices, the rule's probabilities, and the
    calibrated probabilities from maps fitted on the other folds (what plots and reports read)."""

    labels: list[int]
    before: list[list[float]]
    after: list[list[float]]
