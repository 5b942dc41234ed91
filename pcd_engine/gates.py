"""Gated decisions: a tool's arguments are scored only where that tool is chosen.

A tool decision's schema (tools.py) holds the decision and every candidate tool's closed arguments,
each under its tool's name. Scored in one pass, the arguments cost most of it: on bitext's 11 tools,
183 of the 208 tree tokens fed are arguments, though only the chosen tool's are read. So the schema
says which decision each group depends on (`pcd_tools`' sibling `pcd_gates`) and the plan marks those
decisions gated (`SchemaPlan.gates`):

    first call:  prompt + ungated trees (the decision, ...)          KV kept
    decide:      the gate decisions, through the call's calibration where it has one
    second call: the chosen tool's argument trees, on the kept KV    (continuation.pack_trees)

Each gated tree token sees what it would have seen beside the first call's trees, at the same
positions, so its scores are exactly those of one pass. The other tools' arguments are not scored:
their decisions are left out of the answer and their group takes its default, None. A request whose
first call was not kept (its trees ran in microbatches) feeds its text again with the chosen trees.

Heads read the text's hidden states from the first call and each gated tree's fork state from the
second (a tree not fed has none, and no head reads it). The pipeline gates only where the answer
cannot depend on the trees it skips: not where an FP32 re-scorer may change the decision after the
second call, not while scoring for several calibrations at once, and not while fitting a calibration
(every labeled argument is scored there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pcd_engine.calibration import Calibration, apply_all
from pcd_engine.hidden import HiddenStates
from pcd_engine.plan import SchemaPlan
from pcd_engine.results import FieldResult


def first_pass(plan: SchemaPlan, runs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """A request's scores of `plan.first_trees` (what the first call returns) as one entry per tree of
    the plan, None for a gated tree (`decisions.decide` leaves its decision out)."""
    out: list[torch.Tensor | None] = [None] * len(plan.trees)
    for k, scores in zip(plan.first_trees, runs, strict=True):
        out[k] = scores
    return out


def open_paths(
    plan: SchemaPlan,
    fields: Mapping[str, FieldResult],
    calibration: Calibration | None = None,
    hidden: HiddenStates | None = None,
) -> set[str]:
    """The gated decisions whose gate holds for one request: the gate decision's value, through
    `calibration` where it has a map for it (the value the answer will give; a head reads `hidden`),
    is the gate's."""
    wanted = {path for path, _ in plan.gates.values()}
    decided = {p: fields[p] for p in wanted if p in fields}
    if calibration is not None:
        decided = apply_all(calibration.fields, decided, hidden)
    gates = plan.gates.items()
    return {path for path, (gate, value) in gates if gate in decided and decided[gate].value == value}


def wanted_trees(plan: SchemaPlan, opened: set[str]) -> list[int]:
    """The gated trees (numbered as in `plan.trees`) of the open decisions."""
    return [
        k
        for k, dp in enumerate(plan.scored_decisions)
        if dp.decision.path in plan.gates and dp.decision.path in opened
    ]


def in_plan_order(
    plan: SchemaPlan, fields: Mapping[str, FieldResult], opened: set[str]
) -> dict[str, FieldResult]:
    """A request's fields in the plan's order, without the gated decisions whose gate does not hold
    (single-value arguments of a tool not chosen too: their group is left out whole)."""
    return {
        dp.decision.path: fields[dp.decision.path]
        for dp in plan.decisions
        if dp.decision.path in fields and (dp.decision.path not in plan.gates or dp.decision.path in opened)
    }
