"""Calibration: per field, a map from the rule's scores to probabilities that match how often it is right.

    the rule's log-scores z (one per allowed value, prior already subtracted)
        -> z / temperature + bias -> softmax -> calibrated probabilities (the answer is their argmax)

A `Calibration` holds one map per scored field (fitted by `fitting.py` from the user's texts), what it
was fitted for (the plan's fingerprint, the model's identity, each field's rule) and its
cross-validated report; it refuses to be applied to anything else. `save`/`load` write it as JSON.
`abstain` marks the fields whose confidence is below a threshold.

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

from pcd_engine.errors import CalibrationError
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

    def apply(self, result: FieldResult) -> FieldResult:
        if result.source != "scored" or result.rule == "fixed":
            return result
        probs = torch.softmax(self.logits(torch.tensor(list(result.log_scores.values()))), dim=0).tolist()
        values = list(result.log_scores)
        chosen = max(range(len(probs)), key=probs.__getitem__)
        runner_up = max((p for i, p in enumerate(probs) if i != chosen), default=0.0)
        return dataclasses.replace(
            result,
            value=values[chosen],
            probabilities=dict(zip(values, probs, strict=True)),
            margin=probs[chosen] - runner_up,
            calibrated=self.method != "none",
            calibration=self.method,
        )


@dataclass(frozen=True)
class ModelIdentity:
    """Which weights scores came from. `config` hashes the model's configuration (paths, dtype and
    versions left out); `probe` holds the norms of slices of a few weight tensors, compared with a
    1% tolerance so that the same weights in another dtype or device still match."""

    name: str
    config: str
    probe: tuple[float, ...]

    def matches(self, other: ModelIdentity) -> bool:
        return (
            self.config == other.config
            and len(self.probe) == len(other.probe)
            and all(
                math.isclose(a, b, rel_tol=1e-2, abs_tol=1e-6)
                for a, b in zip(self.probe, other.probe, strict=True)
            )
        )


def model_identity(model: Any, probes: int = 8, width: int = 4096) -> ModelIdentity:
    config = getattr(model, "config", None)
    data = config.to_dict() if config is not None else {}
    skip = {"_name_or_path", "name_or_path", "torch_dtype", "dtype", "transformers_version", "_commit_hash"}
    text = json.dumps({k: v for k, v in data.items() if k not in skip}, sort_keys=True, default=str)
    params = [p for _, p in model.named_parameters()]
    picked = [
        params[round(i * (len(params) - 1) / max(probes - 1, 1))] for i in range(min(probes, len(params)))
    ]
    with torch.no_grad():
        probe = tuple(float(p.detach().reshape(-1)[:width].float().norm()) for p in picked)
    name = str(data.get("_name_or_path") or type(model).__name__)
    return ModelIdentity(name, hashlib.sha256(text.encode()).hexdigest(), probe)


@dataclass(frozen=True)
class Calibration:
    """Fitted field maps plus what they were fitted for, and the cross-validated report."""

    fields: Mapping[str, FieldCalibration]
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
        rules = plan_rules(plan)
        if rules != dict(self.rules):
            wrong = sorted(p for p in rules if rules[p] != self.rules.get(p))
            raise CalibrationError(
                f"field {wrong[0]!r} is scored with rule {rules[wrong[0]]!r}, but the calibration was "
                f"fitted with {self.rules.get(wrong[0])!r}; use the same rule"
            )

    def apply(self, fields: Mapping[str, FieldResult]) -> dict[str, FieldResult]:
        return apply_all(self.fields, fields)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "schema": self.schema,
            "model": dataclasses.asdict(self.model),
            "rules": dict(self.rules),
            "fields": {path: dataclasses.asdict(f) for path, f in self.fields.items()},
            "report": self.report,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(
            json.dumps(self.to_json(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
        )

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r} is not {FORMAT!r}")
            model = data["model"]
            fields = {
                p: FieldCalibration(
                    f["method"], tuple(f["values"]), float(f["temperature"]), tuple(f["bias"])
                )
                for p, f in data["fields"].items()
            }
            identity = ModelIdentity(model["name"], model["config"], tuple(model["probe"]))
            return cls(fields, data["schema"], identity, data["rules"], data.get("report", {}))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CalibrationError(f"cannot load a calibration from {path}: {error}") from None


def plan_rules(plan: SchemaPlan) -> dict[str, str]:
    return {dp.decision.path: dp.rule.name for dp in plan.scored_decisions}


def apply_all(
    calibrations: Mapping[str, FieldCalibration], fields: Mapping[str, FieldResult]
) -> dict[str, FieldResult]:
    return {p: calibrations[p].apply(f) if p in calibrations else f for p, f in fields.items()}


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
