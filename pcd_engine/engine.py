"""PCDEngine: compile -> render -> one packed branch pass -> score -> validate -> PCDResult."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from pydantic import BaseModel

from pcd_engine.cache import PrefixCache
from pcd_engine.errors import InputError, PCDError
from pcd_engine.loading import load_model_and_tokenizer
from pcd_engine.packing import BranchRunner, PassStats
from pcd_engine.plan import DecisionPlan, SchemaPlan, build_plan
from pcd_engine.prompt import ChatPrompt, PromptIds
from pcd_engine.results import Diagnostics, FieldResult, PCDResult
from pcd_engine.schema import Limits, compile_schema
from pcd_engine.scoring import Rule, get_rule

T = TypeVar("T", bound=BaseModel)
CONTENT_FREE_TEXTS = ("N/A", "", "[MASK]")
DEFAULT_RULE = "option-cc"  # chosen by benchmarks/accuracy_latency.py; see docs/benchmarks.md


class PCDEngine:
    """Typed classification with parallel constrained decoding over any Hugging Face causal LM.

    >>> from typing import Literal
    >>> from pydantic import BaseModel
    >>> class Ticket(BaseModel):
    ...     topic: Literal["billing", "bug", "other"]
    ...     urgent: bool
    >>> engine = PCDEngine.from_pretrained("openbmb/MiniCPM5-2B")  # doctest: +SKIP
    >>> result = engine.classify("I was charged twice!", Ticket)  # doctest: +SKIP
    >>> result.value.topic, result.fields["topic"].probabilities  # doctest: +SKIP
    ('billing', {'billing': 0.97, 'bug': 0.01, 'other': 0.02})

    Options: `rule` ("option", "option-mean", "greedy", "code" or a Rule object), `limits`,
    `chat_template_kwargs` (e.g. `{"enable_thinking": False}`), `instructions` (default system
    instructions), `max_tokens_per_forward` (microbatch budget), `prefix_cache` (True, False or a
    shared `PrefixCache`: reuse the KV of the per-schema prompt head across calls).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        rule: str | Rule = DEFAULT_RULE,
        limits: Limits | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        instructions: str | None = None,
        max_tokens_per_forward: int = 2048,
        prefix_cache: bool | PrefixCache = True,
    ) -> None:
        if max_tokens_per_forward < 1:
            raise ValueError(f"max_tokens_per_forward must be >= 1, got {max_tokens_per_forward}")
        self.model = model
        self.tokenizer = tokenizer
        self.rule = get_rule(rule)
        self.limits = limits or Limits()
        self.instructions = instructions
        self.prompt = ChatPrompt(tokenizer, chat_template_kwargs)
        self.runner = BranchRunner(model, max_tokens_per_forward)
        self.prefix_cache: PrefixCache | None = (
            PrefixCache()
            if prefix_cache is True
            else prefix_cache
            if isinstance(prefix_cache, PrefixCache)
            else None
        )
        self._plans: dict[tuple[Any, ...], SchemaPlan] = {}
        self._prior_cache: dict[int, list[torch.Tensor]] = {}
        self._plans_lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike[str],
        *,
        revision: str | None = None,
        gguf_file: str | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype | None = None,
        model_kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> PCDEngine:
        """Load a hub id (pin `revision`), a local folder, or a GGUF file, then build the engine."""
        model, tokenizer = load_model_and_tokenizer(
            name_or_path,
            revision=revision,
            gguf_file=gguf_file,
            device=device,
            dtype=dtype,
            **dict(model_kwargs or {}),
        )
        return cls(model, tokenizer, **options)

    def plan(
        self, schema: type[BaseModel], *, instructions: str | None = None, rule: str | Rule | None = None
    ) -> SchemaPlan:
        """The cached SchemaPlan for a schema (compiles it on first use; raises schema errors)."""
        compiled = compile_schema(schema, self.limits)
        chosen_rule = self.rule if rule is None else get_rule(rule)
        text = instructions if instructions is not None else self.instructions
        key = (schema, chosen_rule, text)
        with self._plans_lock:
            plan = self._plans.get(key)
            if plan is None:
                plan = build_plan(compiled, self.prompt, chosen_rule, text, self.limits)
                self._plans[key] = plan
        return plan

    def classify(
        self,
        text: str,
        schema: type[T],
        *,
        instructions: str | None = None,
        rule: str | Rule | None = None,
    ) -> PCDResult[T]:
        """Classify one text into a validated `schema` instance with per-field probabilities."""
        started = time.perf_counter()
        plan = self.plan(schema, instructions=instructions, rule=rule)
        prompt = self._render(plan, text, index=None)
        rendered = time.perf_counter()
        return self._score(plan, prompt, started, rendered)

    def classify_batch(
        self,
        texts: Iterable[str],
        schema: type[T],
        *,
        instructions: str | None = None,
        rule: str | Rule | None = None,
        return_exceptions: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> list[PCDResult[T] | PCDError]:
        """Classify many texts; one entry per input, in order.

        Every input is checked before any model work. With `return_exceptions=True`, an input that
        cannot be classified yields its `PCDError` in place and the others are still classified;
        otherwise the first such error is raised. `progress(n)` is called after each input.
        """
        plan = self.plan(schema, instructions=instructions, rule=rule)
        items: list[PromptIds | PCDError] = []
        for index, text in enumerate(texts):
            try:
                items.append(self._render(plan, text, index=index))
            except PCDError as error:
                if not return_exceptions:
                    raise
                items.append(error)
        results: list[PCDResult[T] | PCDError] = []
        for item in items:
            if isinstance(item, PCDError):
                results.append(item)
            else:
                started = time.perf_counter()
                try:
                    results.append(self._score(plan, item, started, started))
                except PCDError as error:
                    if not return_exceptions:
                        raise
                    results.append(error)
            if progress is not None:
                progress(1)
        return results

    def _render(self, plan: SchemaPlan, text: Any, index: int | None) -> PromptIds:
        where = "text" if index is None else f"text #{index}"
        if not isinstance(text, str):
            raise InputError(f"{where} must be a str, got {type(text).__name__}")
        prompt = self.prompt.with_head(plan.head, text)
        if len(prompt) > self.limits.max_prompt_tokens:
            raise InputError(
                f"{where}: the prompt is {len(prompt)} tokens, over the limit of "
                f"{self.limits.max_prompt_tokens} (Limits.max_prompt_tokens); shorten the text"
            )
        return prompt

    def compare_rules(
        self, text: str, schema: type[T], rules: Sequence[str | Rule] = ("option", "option-mean", "greedy")
    ) -> dict[str, PCDResult[T]]:
        """Results of several rules that share one layout, all from the same packed pass."""
        chosen = [get_rule(r) for r in rules]
        if len({r.uses_codes for r in chosen}) > 1:
            raise ValueError("rules with and without codes use different prompts; compare them separately")
        started = time.perf_counter()
        plan = self.plan(schema, rule=chosen[0])
        prompt = self._render(plan, text, index=None)
        return {
            r.name: result
            for r, result in zip(chosen, self._score(plan, prompt, started, started, chosen), strict=True)
        }

    def _score(
        self,
        plan: SchemaPlan,
        prompt: PromptIds,
        started: float,
        rendered: float,
        rules: Sequence[Rule] | None = None,
    ) -> Any:
        """One packed pass, then a PCDResult per rule (the plan's rules when `rules` is None)."""
        stats = PassStats()
        logprobs = self.runner.run(prompt.ids, plan.trees, stats, self.prefix_cache, len(plan.head))
        forwarded = time.perf_counter()
        each: Sequence[Rule | None] = rules or [None]
        wanted = list(rules) if rules else [dp.rule for dp in plan.decisions]
        priors = self._priors(plan, stats) if any(r.corrects_prior for r in wanted) else None
        results = [self._assemble(plan, logprobs, rule, priors) for rule in each]
        done = time.perf_counter()
        diagnostics = Diagnostics(
            prompt_tokens=len(prompt),
            cached_tokens=stats.reused_tokens,
            branch_tokens=plan.branch_tokens,
            forward_calls=stats.forward_calls,
            timings_ms={
                "render": (rendered - started) * 1e3,
                "forward": (forwarded - rendered) * 1e3,
                "score": (done - forwarded) * 1e3,
                "total": (done - started) * 1e3,
            },
        )
        out = [PCDResult(value, fields, diagnostics) for value, fields in results]
        return out if rules else out[0]

    def _priors(self, plan: SchemaPlan, stats: PassStats) -> list[torch.Tensor]:
        """Per tree, the log of the mean probability over content-free texts (cached per plan)."""
        with self._plans_lock:
            cached = self._prior_cache.get(id(plan))
        if cached is not None:
            return cached
        runs = []
        for text in CONTENT_FREE_TEXTS:
            ids = self.prompt.with_head(plan.head, text).ids
            runs.append(self.runner.run(ids, plan.trees, stats, self.prefix_cache, len(plan.head)))
        count = torch.log(torch.tensor(float(len(runs))))
        priors = [
            torch.logsumexp(torch.stack(per_tree), dim=0) - count for per_tree in zip(*runs, strict=True)
        ]
        with self._plans_lock:
            self._prior_cache[id(plan)] = priors
        return priors

    @staticmethod
    def _assemble(
        plan: SchemaPlan,
        logprobs: list[torch.Tensor],
        rule: Rule | None,
        priors: list[torch.Tensor] | None,
    ) -> tuple[BaseModel, dict[str, FieldResult]]:
        no_priors: list[torch.Tensor | None] = [None] * len(logprobs)
        rows = iter(zip(logprobs, priors or no_priors, strict=True))
        fields: dict[str, FieldResult] = {}
        for dp in plan.decisions:
            used = dp.rule if rule is None or dp.rule.uses_codes != rule.uses_codes else rule
            if dp.tree is None:
                fields[dp.decision.path] = _field_result(dp, None, used)
                continue
            lp, prior = next(rows)
            if used.corrects_prior and prior is not None:
                lp = lp - prior
            fields[dp.decision.path] = _field_result(dp, lp, used)
        value = plan.compiled.validate({path: f.value for path, f in fields.items()})
        return value, fields


def _field_result(dp: DecisionPlan, logprobs: torch.Tensor | None, used: Rule) -> FieldResult:
    values = [c.value for c in dp.decision.candidates]
    if dp.tree is None or logprobs is None:
        return FieldResult(dp.decision.path, values[0], {values[0]: 1.0}, {values[0]: 0.0}, 1.0, "fixed")
    scores = used.score(dp.tree, logprobs)
    runner_up = max(p for i, p in enumerate(scores.probabilities) if i != scores.chosen)
    return FieldResult(
        dp.decision.path,
        values[scores.chosen],
        dict(zip(values, scores.probabilities, strict=True)),
        dict(zip(values, scores.log_scores, strict=True)),
        scores.probabilities[scores.chosen] - runner_up,
        used.name,
    )
