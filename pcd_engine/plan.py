"""SchemaPlan: a compiled schema bound to a tokenizer, a rule and instructions.

Built once per (schema, rule, instructions, examples) and cached by the engine: the system text, the
token ids of the shared prompt head (labeled examples ride in it as earlier turns), one token tree per
decision and, for a model with open fields, its JSON schema. A request then only encodes its own text.
What requests read on every call (the trees, which need a normaliser, how many tokens they feed) is
computed once per plan.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch

from pcd_engine import packing, shortlist
from pcd_engine.bounded_cache import BoundedCache
from pcd_engine.branches import TokenTree, build_tree, cut_tree, rows_in
from pcd_engine.errors import InputError, SchemaLimitError, TokenizationError, UnsupportedSchemaError
from pcd_engine.json_schema import capped, describe, field_schema, model_schema
from pcd_engine.prompt import LAYOUTS, ChatPrompt
from pcd_engine.rules import ContextualCalibration, OptionRule, Rule
from pcd_engine.schema import YES_NO, CompiledSchema, Decision, JSONScalar, Limits
from pcd_engine.wording import (
    WORDINGS,
    branch_text,
    candidate_text,
    code_candidates,
    plain_answer,
    system_text,
)


@dataclass(frozen=True)
class DecisionPlan:
    decision: Decision
    tree: TokenTree | None  # None: a single allowed value, nothing to score
    rule: Rule  # the rule used for this decision (code falls back to option where codes collide)
    whole: TokenTree | None = None  # a shortlisted decision's whole tree (`tree` is then its cut)
    keep: int = 0  # how many values a shortlisted decision scores whole (shortlist.py)

    @property
    def rule_name(self) -> str:
        """The rule, and the shortlist when the decision has one (`option-cc+top8`)."""
        return f"{self.rule.name}+top{self.keep}" if self.whole is not None else self.rule.name

    @cached_property
    def first_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A shortlisted decision's cut tree in its whole tree's scores: (rows, columns)."""
        assert self.tree is not None and self.whole is not None
        return rows_in(self.tree, self.whole)


@dataclass(frozen=True)
class SchemaPlan:
    compiled: CompiledSchema
    system: str
    head: tuple[int, ...]
    decisions: tuple[DecisionPlan, ...]
    json_schema: dict[str, Any] | None = None  # the model's JSON schema (capped), when it has open fields
    examples: tuple[tuple[str, str], ...] = ()  # (text, answer) turns rendered into the head
    wording: str = "json"  # how branches write a value (layout.WORDINGS)
    tools: tuple[dict[str, Any], ...] = ()  # tool definitions the template renders in the head
    layout: str = "chat"  # the prompt layout (prompt.LAYOUTS): a raw prompt's plan has no system text
    # per gated decision path, the (decision path, value) it is scored under (`_gates`, gates.py)
    gates: dict[str, tuple[str, JSONScalar]] = field(default_factory=dict)

    @cached_property
    def fingerprint(self) -> str:
        """What scores depend on besides the model and rule: every decision's path and values, the
        whole head text (instructions, descriptions, examples, tools) and the branch wording.
        Calibrations are keyed by it."""
        decisions = [[d.decision.path, [c.json for c in d.decision.candidates]] for d in self.decisions]
        parts: list[Any] = [decisions, self.system, self.examples, self.wording]
        if self.tools:
            parts.append(self.tools)
        if self.layout != "chat":
            parts.append(self.layout)
        text = json.dumps(parts, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    @cached_property
    def scored_decisions(self) -> tuple[DecisionPlan, ...]:
        """The decisions that have a token tree (more than one allowed value), in tree order."""
        return tuple(d for d in self.decisions if d.tree is not None)

    @cached_property
    def trees(self) -> tuple[TokenTree, ...]:
        """What the (first) scoring pass feeds, per scored decision."""
        return tuple(d.tree for d in self.scored_decisions if d.tree is not None)

    @cached_property
    def prior_trees(self) -> tuple[TokenTree, ...]:
        """What the content-free priors are computed on: the whole tree of a shortlisted decision
        (its cut tree and its second pass read parts of that prior)."""
        return tuple(d.whole or d.tree for d in self.scored_decisions if d.tree is not None)

    @cached_property
    def shortlisted(self) -> bool:
        return any(d.whole is not None for d in self.decisions)

    @cached_property
    def normalized(self) -> tuple[bool, ...]:
        """Per tree, whether its rule needs log-probs normalised over the whole vocabulary."""
        return tuple(d.rule.needs_normalizer for d in self.scored_decisions)

    @cached_property
    def first_trees(self) -> tuple[int, ...]:
        """The trees (numbered as in `trees`) a gated pass feeds first: those of ungated decisions."""
        return tuple(k for k, dp in enumerate(self.scored_decisions) if dp.decision.path not in self.gates)

    @cached_property
    def branch_tokens(self) -> int:
        """Tree tokens a pass feeds (chain tokens the trees share, once)."""
        return packing.fed_tokens(self.trees)


class PlanCache:
    """Plans built once per (schema, rule, instructions, examples), safe under threads, the
    `max_plans` most recently used kept (`plans`, a BoundedCache: instructions come from clients).
    `check` runs on every new plan with open fields (their grammar must compile) before it is kept."""

    def __init__(
        self,
        prompt: ChatPrompt,
        limits: Limits,
        check: Callable[[SchemaPlan], None] | None = None,
        wording: str = "json",
        shortlist: shortlist.ShortlistPolicy | None = None,
        max_plans: int = 256,
    ) -> None:
        if wording not in WORDINGS:
            raise ValueError(f"unknown branch wording {wording!r}; choose one of {WORDINGS}")
        self.prompt = prompt
        self.limits = limits
        self.wording = wording
        self.check = check
        self.shortlist = shortlist
        self.plans: BoundedCache[tuple[Any, ...], SchemaPlan] = BoundedCache(max_plans)

    def get(
        self,
        compiled: CompiledSchema,
        rule: Rule,
        instructions: str | None,
        examples: tuple[tuple[str, str], ...] = (),
        layout: str = "chat",
        shortlisted: bool = True,
    ) -> SchemaPlan:
        """The plan; `shortlisted=False`: every decision's whole tree, whatever the policy."""
        key = (compiled.schema, rule, instructions, examples, layout, shortlisted)
        plan = self.plans.get(key)
        if plan is None:
            limits, wording = self.limits, self.wording
            policy = self.shortlist if shortlisted else None
            plan = build_plan(
                compiled, self.prompt, rule, instructions, limits, examples, wording, layout, policy
            )
            if plan.json_schema is not None and self.check is not None:
                self.check(plan)
            plan = self.plans.put(key, plan)
        return plan


def build_plan(
    compiled: CompiledSchema,
    prompt: ChatPrompt,
    rule: Rule,
    instructions: str | None,
    limits: Limits,
    examples: tuple[tuple[str, str], ...] = (),
    wording: str = "json",
    layout: str = "chat",
    policy: shortlist.ShortlistPolicy | None = None,
) -> SchemaPlan:
    """The plan of a compiled schema; with a shortlist `policy`, the decisions it shortlists are
    scored in two passes (shortlist.py)."""
    if layout != "chat":
        return _raw_plan(compiled, prompt, rule, limits, examples, layout, wording, policy)
    plans, codes = [], {}
    for decision in compiled.decisions:
        field = compiled.fields[decision.field_index]
        depth = len(decision.json_keys)
        if len(decision.candidates) < 2:
            plans.append(DecisionPlan(decision, None, rule))
            continue
        if rule.uses_codes and not field.multi_label:
            coded = _code_tree(prompt, decision, depth, wording)
            if coded is not None:
                codes[decision.field_index] = coded[1]
                plans.append(DecisionPlan(decision, coded[0], rule))
                continue
        texts = [candidate_text(c.json, depth, wording) for c in decision.candidates]
        used = OptionRule("sum") if rule.uses_codes else rule  # a field without codes
        cut = used.until_unique or (used.cut_bools and decision.candidates == YES_NO)
        tree = build_tree(prompt.encode_text, branch_text(decision.json_keys, wording), texts, cut)
        _check_lengths(tree, decision, limits)
        plans.append(DecisionPlan(decision, tree, used))
    schema, described = None, {}
    if compiled.open_fields:
        schema = capped(model_schema(compiled.schema), limits.max_string_length, limits.max_list_items)
        defs = schema.get("$defs", {})
        described = {f.path: describe(field_schema(schema, f.json_keys), defs) for f in compiled.open_fields}
    system = prompt.framed_system(system_text(compiled, instructions, codes, described, wording))
    if codes and examples:  # the examples answer the way the branches do: with the codes
        examples = tuple((text, _coded(answer, compiled, codes)) for text, answer in examples)
    if wording == "plain" and not compiled.open_fields:
        examples = tuple((text, plain_answer(compiled, answer)) for text, answer in examples)
    # A tool decision's schema (tools.py) carries its tool definitions: a template with a tool
    # protocol renders them in the head; elsewhere the schema's description lists them.
    tools = tuple(getattr(compiled.schema, "pcd_tools", ()))
    if tools and prompt.supports_tools:
        head = prompt.render_head(system, examples, tools)
    else:
        head, tools = prompt.render_head(system, examples), ()
    decisions = _shortlisted(plans, policy)
    gates = _gates(compiled, decisions, policy)
    return SchemaPlan(compiled, system, head, decisions, schema, examples, wording, tools, gates=gates)


def _raw_plan(
    compiled: CompiledSchema,
    prompt: ChatPrompt,
    rule: Rule,
    limits: Limits,
    examples: tuple[tuple[str, str], ...],
    layout: str,
    wording: str,
    policy: shortlist.ShortlistPolicy | None,
) -> SchemaPlan:
    """The plan after a raw prompt: no system text, the tokenizer's BOS (if any) as the head, no
    codes (nothing lists them) and no content-free prior (the prompt's wording is the caller's, so
    there is no content-free input to take one from: a `-cc` rule's base rule applies). "raw-value"
    writes a one-field schema's value alone; where one value's tokens begin another's, every value
    ends with the end-of-text token."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown prompt layout {layout!r}; choose one of {LAYOUTS}")
    if examples:
        raise InputError("labeled examples go in a chat prompt's head: a raw prompt holds its own")
    if layout == "raw-value":
        if len(compiled.decisions) != 1 or compiled.open_fields or compiled.fields[0].multi_label:
            raise UnsupportedSchemaError(
                compiled.schema.__name__, compiled.schema, "a value answer needs a schema of one closed field"
            )
        wording = "value"
    used = OptionRule("sum") if rule.uses_codes else rule
    used = used.base if isinstance(used, ContextualCalibration) else used
    plans = []
    for decision in compiled.decisions:
        if len(decision.candidates) < 2:
            plans.append(DecisionPlan(decision, None, used))
            continue
        texts = [candidate_text(c.json, len(decision.json_keys), wording) for c in decision.candidates]
        cut = used.until_unique or (used.cut_bools and decision.candidates == YES_NO)
        branch = branch_text(decision.json_keys, wording)
        try:
            tree = build_tree(prompt.encode_text, branch, texts, cut)
        except TokenizationError:  # a bare value whose tokens begin another's
            eos = prompt.tokenizer.eos_token_id
            if eos is None:
                why = "one value's tokens begin another's, and the tokenizer has no end-of-text token"
                raise UnsupportedSchemaError(decision.path, compiled.schema, why) from None
            tree = build_tree(prompt.encode_text, branch, texts, cut, end=(eos,))
        _check_lengths(tree, decision, limits)
        plans.append(DecisionPlan(decision, tree, used))
    schema = None
    if compiled.open_fields:
        schema = capped(model_schema(compiled.schema), limits.max_string_length, limits.max_list_items)
    decisions = _shortlisted(plans, policy)
    return SchemaPlan(compiled, "", prompt.raw_head, decisions, schema, (), wording, (), layout)


def _shortlisted(
    plans: list[DecisionPlan], policy: shortlist.ShortlistPolicy | None
) -> tuple[DecisionPlan, ...]:
    """The decisions with their first-pass (cut) trees where the policy shortlists them."""
    if policy is None:
        return tuple(plans)
    chosen = policy.shortlisted([(dp.rule, dp.tree) for dp in plans])
    return tuple(
        replace(dp, tree=cut_tree(dp.tree), whole=dp.tree, keep=policy.size) if pick and dp.tree else dp
        for dp, pick in zip(plans, chosen, strict=True)
    )


def _gates(
    compiled: CompiledSchema, decisions: Sequence[DecisionPlan], policy: shortlist.ShortlistPolicy | None
) -> dict[str, tuple[str, JSONScalar]]:
    """Per decision path, the (decision path, value) under which it is scored, from the schema's
    `pcd_gates` (a tool's arguments depend on the tool chosen: tools.py): scored after that decision
    is made, only where it holds (gates.py). A group is gated only where each of its scored decisions
    can be (a whole tree, not a shortlist's first pass, that starts with tokens of its own, under a
    decision scored in the first pass), and the plan's groups only where the policy says the call it
    adds pays (`ShortlistPolicy.gated`; no policy: one pass)."""
    declared: dict[str, tuple[str, JSONScalar]] = getattr(compiled.schema, "pcd_gates", {})
    if policy is None or not declared:
        return {}
    by_path = {dp.decision.path: dp for dp in decisions}
    out: dict[str, tuple[str, JSONScalar]] = {}
    groups: list[list[TokenTree]] = []
    for group, (path, value) in declared.items():
        gate = by_path.get(path)
        if gate is None or gate.tree is None or path.split(".")[0] in declared:
            continue
        members = [dp for dp in decisions if dp.decision.path.split(".")[0] == group]
        if all(dp.tree is None or (dp.whole is None and dp.tree.root >= 0) for dp in members):
            out.update((dp.decision.path, (path, value)) for dp in members)
            groups.append([dp.tree for dp in members if dp.tree is not None])
    return out if policy.gated(groups) else {}


def _coded(answer: str, compiled: CompiledSchema, codes: dict[int, tuple[str, ...]]) -> str:
    """An example's answer JSON with each coded field's value replaced by its code."""
    data = json.loads(answer)
    for index, field_codes in codes.items():
        f = compiled.fields[index]
        node = data
        for key in f.json_keys[:-1]:
            node = node[key]
        position = [c.value for c in f.candidates].index(node[f.json_keys[-1]])
        node[f.json_keys[-1]] = json.loads(field_codes[position])
    return json.dumps(data, ensure_ascii=False)


def _code_tree(
    prompt: ChatPrompt, decision: Decision, depth: int, wording: str
) -> tuple[TokenTree, tuple[str, ...]] | None:
    codes = code_candidates(decision.candidates)
    if codes is None:
        return None
    texts = [candidate_text(code, depth, wording) for code in codes]
    tree = build_tree(prompt.encode_text, branch_text(decision.json_keys, wording), texts, until_unique=True)
    firsts = [path[0][1] for path in tree.paths]
    return (tree, codes) if len(set(firsts)) == len(firsts) else None


def _check_lengths(tree: TokenTree, decision: Decision, limits: Limits) -> None:
    for candidate, path in zip(decision.candidates, tree.paths, strict=True):
        if len(path) > limits.max_candidate_tokens:
            raise SchemaLimitError(
                "tokens",
                len(path),
                limits.max_candidate_tokens,
                f"candidate {candidate.json} of field {decision.path!r}",
                "max_candidate_tokens",
            )
