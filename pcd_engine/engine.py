"""PCDEngine: compile -> render -> one packed branch pass -> score -> (generate open fields) -> validate.

Closed fields are scored in one packed pass; a model with open fields then generates the rest of its
JSON object with the scored values fixed (filling.py). `generate` / `stream` are plain chat generation.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import torch
from pydantic import BaseModel, ValidationError

from pcd_engine.cache import PrefixCache
from pcd_engine.errors import InputError, PCDError, StructuredOutputError
from pcd_engine.filling import FillJob, JsonFiller, generated_fields
from pcd_engine.generate import Completion, Generator, Sampling, StopStrings
from pcd_engine.loading import load_model_and_tokenizer, resolve_dtype
from pcd_engine.output_types import output_type
from pcd_engine.packing import BranchRunner, PassStats
from pcd_engine.plan import DecisionPlan, SchemaPlan, build_plan
from pcd_engine.precision import (
    PROBE_HEAD,
    PROBE_TEXTS,
    FP32Rescorer,
    PrecisionCheckError,
    ProbeTicket,
    SelfCheck,
    self_check,
)
from pcd_engine.prompt import ChatPrompt, PromptIds
from pcd_engine.results import Diagnostics, FieldResult, Generation, GenerationChunk, PCDResult
from pcd_engine.schema import JSONScalar, Limits, compile_schema
from pcd_engine.scoring import Rule, get_rule

T = TypeVar("T", bound=BaseModel)
Message = Mapping[str, Any] | tuple[str, str]
CONTENT_FREE_TEXTS = ("N/A", "", "[MASK]")
DEFAULT_RULE = "option-cc"  # chosen by benchmarks/accuracy_latency.py; see docs/benchmarks.md


class PCDEngine:
    """Typed classification with parallel constrained decoding over any Hugging Face causal LM.

    >>> from typing import Literal
    >>> from pydantic import BaseModel
    >>> class Ticket(BaseModel):
    ...     topic: Literal["billing", "bug", "other"]
    ...     urgent: bool
    ...     summary: str  # open: generated after the scored fields
    >>> engine = PCDEngine.from_pretrained("openbmb/MiniCPM5-2B")  # doctest: +SKIP
    >>> result = engine.classify("I was charged twice!", Ticket)  # doctest: +SKIP
    >>> result.value.topic, result.fields["topic"].probabilities  # doctest: +SKIP
    ('billing', {'billing': 0.97, 'bug': 0.01, 'other': 0.02})

    Options: `rule` ("option-cc", "option", "option-mean", "greedy", "greedy-cc", "code" or a Rule
    object), `limits`, `chat_template_kwargs` (e.g. `{"enable_thinking": False}`), `instructions`
    (default system instructions), `max_tokens_per_forward` (tokens per forward call, which bounds
    microbatches and batched rows; default 2,048 on CPU, 32,768 on CUDA), `prefix_cache` (True,
    False or a shared `PrefixCache`: reuse the KV of the per-schema prompt head across calls),
    `allow_generation` (generate open fields; False raises UnsupportedSchemaError for them),
    `sampling` (default decoding for generation: greedy), `generation_batch_size` (rows per padded
    generation batch), `stop_token_ids` (end-of-answer ids; default: the model's eos ids and the chat
    template's end-of-turn token), `reference_model` (an FP32 copy of the weights: scored fields whose
    margin is below `rescore_margin` are scored again on it, so close calls match FP32), `self_check`
    (for a model not in float32: compare packed and separate passes on a fixed probe at start-up and
    raise PrecisionCheckError if they disagree; the report is `engine.precision_check`).
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
        max_tokens_per_forward: int | None = None,
        prefix_cache: bool | PrefixCache = True,
        allow_generation: bool = True,
        sampling: Sampling | None = None,
        generation_batch_size: int = 16,
        stop_token_ids: Sequence[int] | None = None,
        reference_model: Any = None,
        rescore_margin: float = 0.2,
        self_check: bool = True,
    ) -> None:
        if max_tokens_per_forward is None:
            on_gpu = next(model.parameters()).device.type == "cuda"
            max_tokens_per_forward = 32768 if on_gpu else 2048
        if max_tokens_per_forward < 1:
            raise ValueError(f"max_tokens_per_forward must be >= 1, got {max_tokens_per_forward}")
        if generation_batch_size < 1:
            raise ValueError(f"generation_batch_size must be >= 1, got {generation_batch_size}")
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
        self.allow_generation = allow_generation
        self.sampling = sampling or Sampling()
        self.generation_batch_size = generation_batch_size
        stops = stop_token_ids if stop_token_ids is not None else _stop_ids(model, tokenizer, self.prompt)
        self.generator = Generator(model, tokenizer, stops, self.runner.cache_kw)
        self.filler = JsonFiller(self.generator, self.prompt, self.limits)
        self._plans: dict[tuple[Any, ...], SchemaPlan] = {}
        self._prior_cache: dict[tuple[int, tuple[bool, ...], int], list[torch.Tensor]] = {}
        self._plans_lock = threading.Lock()
        self.rescorer = (
            FP32Rescorer(
                reference_model, rescore_margin, max_tokens_per_forward, self.prefix_cache is not None
            )
            if reference_model is not None
            else None
        )
        self.precision_check: SelfCheck | None = None
        if self_check and self.runner.dtype != torch.float32:
            self.precision_check = self._self_check()
            if not self.precision_check.passed:
                raise PrecisionCheckError(self.precision_check)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike[str],
        *,
        revision: str | None = None,
        gguf_file: str | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype | None = None,
        fp32_rescore: bool = False,
        model_kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> PCDEngine:
        """Load a hub id (pin `revision`), a local folder, or a GGUF file, then build the engine.

        `dtype` is float32 unless asked otherwise. With `fp32_rescore=True` and a lower `dtype`, the
        weights are loaded in float32 and kept as the re-scoring reference beside a `dtype` copy that
        does the work (memory: both copies).
        """
        wanted = resolve_dtype(dtype)
        keep_fp32 = fp32_rescore and wanted != torch.float32
        model, tokenizer = load_model_and_tokenizer(
            name_or_path,
            revision=revision,
            gguf_file=gguf_file,
            device=device,
            dtype=torch.float32 if keep_fp32 else wanted,
            **dict(model_kwargs or {}),
        )
        if keep_fp32:
            options["reference_model"], model = model, copy.deepcopy(model).to(wanted)
        return cls(model, tokenizer, **options)

    def plan(
        self,
        schema: Any,
        *,
        instructions: str | None = None,
        rule: str | Rule | None = None,
        allow_generation: bool | None = None,
    ) -> SchemaPlan:
        """The cached SchemaPlan for a schema (compiles it on first use; raises schema errors)."""
        model = output_type(schema).model
        compiled = compile_schema(model, self.limits, allow_open=True)
        allowed = self.allow_generation if allow_generation is None else allow_generation
        if compiled.open_fields and not allowed:
            raise compiled.open_fields[0].error()
        chosen_rule = self.rule if rule is None else get_rule(rule)
        text = instructions if instructions is not None else self.instructions
        key = (model, chosen_rule, text)
        with self._plans_lock:
            plan = self._plans.get(key)
        if plan is None:
            plan = build_plan(compiled, self.prompt, chosen_rule, text, self.limits)
            if plan.json_schema is not None:
                self.filler.check(plan)
            with self._plans_lock:
                plan = self._plans.setdefault(key, plan)
        return plan

    @overload
    def classify(
        self,
        text: str,
        schema: type[T],
        *,
        instructions: str | None = None,
        rule: str | Rule | None = None,
        allow_generation: bool | None = None,
        sampling: Sampling | None = None,
    ) -> PCDResult[T]: ...

    @overload
    def classify(
        self,
        text: str,
        schema: Any,
        *,
        instructions: str | None = None,
        rule: str | Rule | None = None,
        allow_generation: bool | None = None,
        sampling: Sampling | None = None,
    ) -> PCDResult[Any]: ...

    def classify(
        self,
        text: str,
        schema: Any,
        *,
        instructions: str | None = None,
        rule: str | Rule | None = None,
        allow_generation: bool | None = None,
        sampling: Sampling | None = None,
    ) -> PCDResult[Any]:
        """Answer one text with a validated `schema` value and per-field results.

        `schema` is a Pydantic model (gives an instance), a TypedDict or a JSON-schema dict (give a
        dict). Closed fields are scored; open fields are generated unless `allow_generation=False`.
        """
        options = _Options(instructions, rule, allow_generation, sampling)
        (result,) = self._run([text], schema, options, return_exceptions=False, single=True)
        assert not isinstance(result, PCDError)
        return result

    def classify_batch(
        self,
        texts: Iterable[str],
        schema: Any,
        *,
        instructions: str | None = None,
        rule: str | Rule | None = None,
        allow_generation: bool | None = None,
        sampling: Sampling | None = None,
        return_exceptions: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> list[PCDResult[Any] | PCDError]:
        """Classify many texts; one entry per input, in order.

        Every input is checked before any model work. With `return_exceptions=True`, an input that
        cannot be answered yields its `PCDError` in place and the others are still answered;
        otherwise the first such error is raised. Open fields are generated in padded batches of
        `generation_batch_size`. `progress(n)` is called as inputs complete.
        """
        options = _Options(instructions, rule, allow_generation, sampling)
        return self._run(list(texts), schema, options, return_exceptions, single=False, progress=progress)

    def compare_rules(
        self, text: str, schema: type[T], rules: Sequence[str | Rule] = ("option", "option-mean", "greedy")
    ) -> dict[str, PCDResult[T]]:
        """Results of several rules that share one layout, all from the same packed pass."""
        chosen = [get_rule(r) for r in rules]
        if len({r.uses_codes for r in chosen}) > 1:
            raise ValueError("rules with and without codes use different prompts; compare them separately")
        started = time.perf_counter()
        plan = self.plan(schema, rule=chosen[0], allow_generation=False)
        prompt = self._render(plan, text, index=None)
        stats = PassStats()
        norms = [any(r.needs_normalizer for r in chosen)] * len(plan.trees)
        logprobs = self.runner.run(prompt.ids, plan.trees, stats, self.prefix_cache, len(plan.head), norms)
        priors = self._priors(plan, stats, norms) if any(r.corrects_prior for r in chosen) else None
        out: dict[str, PCDResult[T]] = {}
        for r in chosen:
            work = _Work(text, prompt, started, {}, plan.branch_tokens, stats)
            work.fields = self._decide(plan, logprobs, r, priors)
            self._validate_closed(plan, work)
            result = work.result(lambda value: value)
            if isinstance(result, PCDError):
                raise result
            out[r.name] = result
        return out

    def generate(
        self,
        messages: Sequence[Message],
        *,
        max_tokens: int = 512,
        stop: Sequence[str] | None = None,
        sampling: Sampling | None = None,
        **sampling_options: Any,
    ) -> Generation:
        """Plain chat generation: messages (role/content dicts or pairs) in, the assistant's text out.

        `stop` strings end the text (they are not included); `max_tokens` bounds the answer; decoding
        is greedy unless `sampling` or `temperature=`, `top_p=`, `min_p=`, `repetition_penalty=`,
        `seed=` say otherwise.
        """
        ids, chosen, stops = self._chat(messages, max_tokens, stop, sampling, sampling_options)
        (completion,) = self.generator.run(
            [ids], max_new_tokens=max_tokens, sampling=chosen, stop_strings=stops.stops
        )
        text = stops.cut(self.tokenizer.decode(completion.ids, skip_special_tokens=True))
        return Generation(text, completion.finish_reason, len(ids), len(completion.ids))

    def stream(
        self,
        messages: Sequence[Message],
        *,
        max_tokens: int = 512,
        stop: Sequence[str] | None = None,
        sampling: Sampling | None = None,
        **sampling_options: Any,
    ) -> Iterator[GenerationChunk]:
        """`generate`, yielding text pieces as tokens are decoded; the last chunk carries the finish
        reason and the token counts. Closing the iterator early stops generation."""
        ids, chosen, stops = self._chat(messages, max_tokens, stop, sampling, sampling_options)
        done: Completion | None = None
        pieces = self.generator.stream(
            ids, max_new_tokens=max_tokens, sampling=chosen, stop_strings=stops.stops
        )
        for piece in pieces:
            if isinstance(piece, Completion):
                done = piece
            elif text := stops.feed(piece):
                yield GenerationChunk(text)
        if rest := stops.flush():
            yield GenerationChunk(rest)
        assert done is not None
        yield GenerationChunk("", done.finish_reason, len(ids), len(done.ids))

    # -- structured requests -------------------------------------------------------------------

    def _run(
        self,
        texts: Sequence[Any],
        schema: Any,
        options: _Options,
        return_exceptions: bool,
        single: bool,
        progress: Callable[[int], None] | None = None,
    ) -> list[PCDResult[Any] | PCDError]:
        target = output_type(schema)
        plan = self.plan(
            target.model,
            instructions=options.instructions,
            rule=options.rule,
            allow_generation=options.allow_generation,
        )
        work: list[_Work | PCDError] = []
        for index, text in enumerate(texts):  # every input is checked before any model work
            started = time.perf_counter()
            try:
                prompt = self._render(plan, text, index=None if single else index)
            except PCDError as error:
                if not return_exceptions:
                    raise
                work.append(error)
                continue
            work.append(_Work(text, prompt, started, {"render": _ms(started)}, plan.branch_tokens))
        generates = plan.json_schema is not None
        ready = [w for w in work if isinstance(w, _Work)]
        self._score(plan, ready)
        for item in work:
            if isinstance(item, _Work) and not generates:
                self._validate_closed(plan, item)
            if progress is not None and not generates:
                progress(1)
        if generates:
            pending = [w for w in work if isinstance(w, _Work)]
            self._fill(plan, pending, options.sampling or self.sampling, single, progress)
            if progress is not None and len(pending) < len(work):
                progress(len(work) - len(pending))
        results: list[PCDResult[Any] | PCDError] = []
        for item in work:
            outcome = item if isinstance(item, PCDError) else item.result(target.to_output)
            if isinstance(outcome, PCDError) and not return_exceptions:
                raise outcome
            results.append(outcome)
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

    def _score(self, plan: SchemaPlan, work: Sequence[_Work]) -> None:
        """The packed pass under the plan's rules, several requests per forward call: fills every
        `work.fields` with the scored decisions."""
        if not work:
            return
        began = time.perf_counter()
        norms = plan.normalized
        prompts = [w.prompt.ids for w in work]
        stats = [w.stats for w in work]
        if not plan.trees:
            runs: list[list[torch.Tensor]] = [[] for _ in work]
        elif len(work) == 1:  # one call even without a prefix cache (run_batch computes the head apart)
            runs = [
                self.runner.run(prompts[0], plan.trees, stats[0], self.prefix_cache, len(plan.head), norms)
            ]
        else:
            runs = self.runner.run_batch(prompts, plan.trees, stats, self.prefix_cache, len(plan.head), norms)
        scoring = time.perf_counter()
        wanted = [dp.rule for dp in plan.decisions]
        priors = self._priors(plan, stats[0], norms) if any(r.corrects_prior for r in wanted) else None
        for w, logprobs in zip(work, runs, strict=True):
            w.fields = self._decide(plan, logprobs, None, priors)
            w.timings["forward"] = (scoring - began) * 1e3 / len(work)
            w.timings["score"] = _ms(scoring) / len(work)
        if self.rescorer is not None:
            for w in work:
                self._rescore(plan, w, self.rescorer)

    def _rescore(self, plan: SchemaPlan, work: _Work, rescorer: FP32Rescorer) -> None:
        """Score again in FP32 every decision whose margin is below the rescorer's threshold."""
        began = time.perf_counter()
        scored = plan.scored_decisions
        low = [k for k, dp in enumerate(scored) if rescorer.needs(work.fields[dp.decision.path].margin)]
        rescorer.checked_fields += len(scored)
        if not low:
            return
        norms = plan.normalized
        stats = PassStats()
        trees = [plan.trees[k] for k in low]
        runner, cache = rescorer.runner, rescorer.prefix_cache
        logprobs = runner.run(work.prompt.ids, trees, stats, cache, len(plan.head), [norms[k] for k in low])
        priors = None
        if any(scored[k].rule.corrects_prior for k in low):
            priors = self._priors(plan, stats, norms, runner, cache)
        for k, lp in zip(low, logprobs, strict=True):
            dp = scored[k]
            if dp.rule.corrects_prior and priors is not None:
                lp = lp - priors[k]
            work.fields[dp.decision.path] = dataclasses.replace(_field_result(dp, lp, dp.rule), rescored=True)
        rescorer.rescored_fields += len(low)
        work.rescored += len(low)
        work.stats.forward_calls += stats.forward_calls
        work.timings["rescore"] = _ms(began)

    def _self_check(self) -> SelfCheck:
        """The probe through the packed path and through separate passes, in the model's dtype."""
        plan = self.plan(ProbeTicket, rule="option", allow_generation=False)
        head = self.prompt.encode_text(PROBE_HEAD)
        prompts = [head + self.prompt.encode_text(text) for text in PROBE_TEXTS]
        return self_check(self.runner, prompts, len(head), plan.trees)

    @staticmethod
    def _validate_closed(plan: SchemaPlan, work: _Work) -> None:
        chosen = work.chosen()
        try:
            work.value = plan.compiled.validate(chosen)
        except ValidationError as error:
            raw = json.dumps(plan.compiled.assemble(chosen), ensure_ascii=False)
            work.error = StructuredOutputError("the scored values failed validation", raw, error)

    def _fill(
        self,
        plan: SchemaPlan,
        work: Sequence[_Work],
        sampling: Sampling,
        single: bool,
        progress: Callable[[int], None] | None,
    ) -> None:
        """Generate the open fields of every request, in padded batches, with one retry each."""
        jobs = [self.filler.job(plan, w.prompt.ids, plan.compiled.closed_values(w.chosen())) for w in work]
        size = self.generation_batch_size
        for start in range(0, len(work), size):
            chunk = range(start, min(start + size, len(work)))
            began = time.perf_counter()
            cache = self._generation_cache(plan, jobs[start].prompt, work[start]) if single else None
            completions = self.generator.run(
                [jobs[i].prompt for i in chunk],
                max_new_tokens=max(jobs[i].budget for i in chunk),
                sampling=sampling,
                matchers=[jobs[i].matcher for i in chunk],
                cache=cache,
            )
            elapsed = _ms(began)
            for i, completion in zip(chunk, completions, strict=True):
                work[i].timings["generate"] = elapsed
                self._finish(plan, work[i], jobs[i], completion, sampling)
                if progress is not None:
                    progress(1)

    def _finish(
        self, plan: SchemaPlan, work: _Work, job: FillJob, completion: Completion, sampling: Sampling
    ) -> None:
        """Parse and validate one generated answer; after a validation error, retry once."""
        for attempt in (1, 2):
            work.attempts = attempt
            work.generated_tokens += completion.steps
            work.stats.forward_calls += completion.steps
            try:
                raw, outcome = self.filler.parse(job, completion, plan.compiled.schema)
            except StructuredOutputError as error:
                error.attempts = attempt
                work.error = error
                return
            if isinstance(outcome, BaseModel):
                work.value = outcome
                work.fields.update(generated_fields(plan, outcome))
                return
            if attempt == 2:
                work.error = StructuredOutputError(
                    "the generated object failed validation", raw, outcome, attempts=attempt
                )
                return
            began = time.perf_counter()
            job = self.filler.job(plan, self.filler.retry_prompt(plan, work.text, raw, outcome), job.closed)
            (completion,) = self.generator.run(
                [job.prompt],
                max_new_tokens=job.budget,
                sampling=sampling,
                matchers=[job.matcher],
                cache=self._generation_cache(plan, job.prompt, work),
            )
            work.timings["retry"] = _ms(began)

    def _generation_cache(self, plan: SchemaPlan, ids: Sequence[int], work: _Work) -> Any:
        """A private copy of the cached prompt head, cropped so that at least one token is left to feed."""
        cache, past = self.runner.cached_prefix(ids, work.stats, self.prefix_cache, len(plan.head))
        if cache is not None and past >= len(ids):
            cache.crop(-(past - len(ids) + 1))
        return cache

    def _priors(
        self,
        plan: SchemaPlan,
        stats: PassStats,
        norms: Sequence[bool],
        runner: BranchRunner | None = None,
        cache: PrefixCache | None = None,
    ) -> list[torch.Tensor]:
        """Per tree, the log of the mean probability over content-free texts (cached per plan and
        model), in the same units as the request's scores (`norms`: log-probs or logits per tree)."""
        runner, cache = (runner, cache) if runner is not None else (self.runner, self.prefix_cache)
        key = (id(plan), tuple(norms), id(runner))
        with self._plans_lock:
            cached = self._prior_cache.get(key)
        if cached is not None:
            return cached
        runs = []
        for text in CONTENT_FREE_TEXTS:
            ids = self.prompt.with_head(plan.head, text).ids
            runs.append(runner.run(ids, plan.trees, stats, cache, len(plan.head), norms))
        count = torch.log(torch.tensor(float(len(runs))))
        priors = [
            torch.logsumexp(torch.stack(per_tree), dim=0) - count for per_tree in zip(*runs, strict=True)
        ]
        with self._plans_lock:
            self._prior_cache[key] = priors
        return priors

    @staticmethod
    def _decide(
        plan: SchemaPlan,
        logprobs: list[torch.Tensor],
        rule: Rule | None,
        priors: list[torch.Tensor] | None,
    ) -> dict[str, FieldResult]:
        """Every decision's FieldResult under `rule` (None: each decision's own rule)."""
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
        return fields

    # -- chat generation -----------------------------------------------------------------------

    def _chat(
        self,
        messages: Sequence[Message],
        max_tokens: int,
        stop: Sequence[str] | str | None,
        sampling: Sampling | None,
        options: Mapping[str, Any],
    ) -> tuple[list[int], Sampling, StopStrings]:
        """Checked inputs of a chat call: prompt ids, sampling, stop strings (InputError if bad)."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InputError(f"max_tokens must be a positive int, got {max_tokens!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if not all(isinstance(s, str) for s in stops):
            raise InputError(f"stop must be a list of strings, got {stop!r}")
        try:
            chosen = Sampling(**{**vars(sampling or self.sampling), **options})
        except TypeError as error:
            raise InputError(f"unknown sampling option: {error}") from error
        pairs = _messages(messages)
        try:
            ids = self.prompt.render_messages(pairs)
        except Exception as error:  # jinja2 TemplateError: roles the template rejects, bad order
            raise InputError(f"the chat template rejected the messages: {error}") from error
        if len(ids) > self.limits.max_prompt_tokens:
            raise InputError(
                f"the prompt is {len(ids)} tokens, over the limit of {self.limits.max_prompt_tokens} "
                "(Limits.max_prompt_tokens)"
            )
        return ids, chosen, StopStrings(stops)


@dataclass
class _Options:
    instructions: str | None
    rule: str | Rule | None
    allow_generation: bool | None
    sampling: Sampling | None


@dataclass
class _Work:
    """One structured request on its way through the engine."""

    text: str
    prompt: PromptIds
    started: float
    timings: dict[str, float]
    branch_tokens: int
    stats: PassStats = field(default_factory=PassStats)
    fields: dict[str, FieldResult] = field(default_factory=dict)
    value: BaseModel | None = None
    error: PCDError | None = None
    generated_tokens: int = 0
    attempts: int = 0
    rescored: int = 0

    def chosen(self) -> dict[str, JSONScalar]:
        return {path: f.value for path, f in self.fields.items() if f.source == "scored"}

    def result(self, to_output: Callable[[BaseModel], Any]) -> PCDResult[Any] | PCDError:
        if self.error is not None:
            return self.error
        assert self.value is not None
        self.timings["total"] = _ms(self.started)
        diagnostics = Diagnostics(
            prompt_tokens=len(self.prompt),
            cached_tokens=self.stats.reused_tokens,
            branch_tokens=self.branch_tokens,
            forward_calls=self.stats.forward_calls,
            timings_ms=dict(self.timings),
            generated_tokens=self.generated_tokens,
            attempts=self.attempts,
            prefix_cache_hit=self.stats.cache_hit,
            rescored_fields=self.rescored,
        )
        return PCDResult(to_output(self.value), self.fields, diagnostics)


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


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1e3


def _messages(messages: Any) -> list[tuple[str, str]]:
    """(role, content) pairs from dicts or pairs; InputError naming the first bad message."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...} items")
    out = []
    for index, message in enumerate(messages):
        if isinstance(message, Mapping):
            role, content = message.get("role"), message.get("content")
        elif isinstance(message, tuple) and len(message) == 2:
            role, content = message
        else:
            raise InputError(f"message #{index} must be a dict with 'role' and 'content' or a pair")
        if not isinstance(role, str) or not isinstance(content, str):
            raise InputError(f"message #{index}: role and content must be strings")
        out.append((role, content))
    return out


def _stop_ids(model: Any, tokenizer: Any, prompt: ChatPrompt) -> list[int]:
    """The model's eos ids, the tokenizer's eos id and the template's end-of-turn token."""
    ids: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (configured, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(int(v) for v in value)
    ids.extend(prompt.end_of_turn_ids)
    return list(dict.fromkeys(ids))
