"""The calibrations `pcd serve` applies: loaded and checked against the served model at start-up,
matched to each structured request by its plan (schema, instructions and rules)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minicpm_pcd_adapters.server.protocol import (
    CalibrationCard,
    CalibrationList,
    CalibrationUsed,
)
from pcd_engine import Calibration, CalibrationError, PCDEngine, SchemaPlan


class Calibrations:
    """The calibration files a server was started with, by name (the file name without `.json`),
    each checked against the served model at start-up (CalibrationError naming the file)."""

    def __init__(self, engine: PCDEngine, paths: Sequence[str]) -> None:
        self.engine = engine
        self.by_name: dict[str, Calibration] = {}
        for path in paths:
            name = Path(path).name.removesuffix(".json")
            if name in self.by_name:
                raise ValueError(f"two calibration files are named {name!r}; rename one")
            calibration = Calibration.load(path)
            if not calibration.model.matches(engine.model_identity):
                raise CalibrationError(
                    f"{path} was fitted on model {calibration.model.name!r}, not on the served model "
                    f"{engine.model_identity.name!r} (its configuration or weights differ)"
                )
            if calibration.model.precision != engine.model_identity.precision:
                raise CalibrationError(
                    f"{path} was fitted on scores computed in {calibration.model.precision}; the served "
                    f"engine computes them in {engine.model_identity.precision}"
                )
            self.by_name[name] = calibration

    def match(self, plan: SchemaPlan, switches: Sequence[Any] = ()) -> str | None:
        """The name of the first calibration fitted for this plan (schema, prompt and rules); none
        for a request with template `switches` of its own, since calibrations are fitted on prompts
        rendered with the served ones."""
        if switches:
            return None
        for name, calibration in self.by_name.items():
            try:
                calibration.check(plan, self.engine.model_identity)
            except CalibrationError:
                continue
            return name
        return None

    def describe(self, name: str | None) -> CalibrationUsed | None:
        """What `choice.pcd.calibration` says: the name and each field's method (None: none matched)."""
        if name is None:
            return None
        fields = self.by_name[name].fields
        return CalibrationUsed(name=name, methods={path: f.method for path, f in fields.items()})

    def listing(self) -> CalibrationList:
        cards = [
            CalibrationCard(
                id=name,
                object="calibration",
                schema=c.schema,
                model=c.model.name,
                methods={path: f.method for path, f in c.fields.items()},
            )
            for name, c in self.by_name.items()
        ]
        return CalibrationList(object="list", data=cards)
