"""PCDEngine: the request pipeline, wired from the modules that do the work.

    plan (schema + tokenizer + rule + examples, cached)   pipeline.py -> plan.py
    1. render every input; a bad input fails here         pipeline.py -> request.py
    2. score the closed fields in packed passes           pipeline.py -> scorer.py, decisions.py
    3. re-score close calls in FP32                       pipeline.py -> precision.py
    4. calibrate the scored fields, mark abstentions      pipeline.py -> calibration.py
    5. validate the closed answer, or generate the        request.py / filling.py
       open fields after the scored ones
    6. one result or error per input, in order            request.py

Phases 1 to 4 are the public methods of `engine.pipeline` (pipeline.py), which `_run` calls in
order. `generate` / `stream` are plain chat generation on `engine.generator` (chat.py, generate.py);
`calibrate`, `score_fields` and `suggest_labels` learn from the user's texts on `engine.pipeline`
(learning.py); `engine.tools` decides tool calls, the tool being one more scored field (tools.py,
tool_calls.py). The per-call options are declared once, in options.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any, TypeVar, overload

import torch
from pydantic import BaseModel
from typing_extensions import Unpack

from pcd_engine import comparison, precision
from pcd_engine.bounded_cache import BoundedCache
from pcd_engine.cache import PrefixCache
from pcd_engine.calibration import ModelIdentity
from pcd_engine.chat import ChatMixin, stop_ids
from pcd_engine.conversation import system_texts
from pcd_engine.errors import CalibrationError, PCDError, PrecisionCheckError
from pcd_engine.filling import JsonFiller
from pcd_engine.generate import Generator, Sampling
from pcd_engine.grouped_attention import use_grouped_attention
from pcd_engine.learning import LearningMixin
from pcd_engine.loading import load_with_reference
from pcd_engine.options import ClassifyOptions, PlanOptions, RequestOptions
from pcd_engine.output_types import DICT_MODELS, output_type
from pcd_engine.packed_weights import pack_linears, pays
from pcd_engine.pipeline import Pipeline
from pcd_engine.plan import PlanCache, SchemaPlan
from pcd_engine.prompt import ChatPrompt, TextInput, input_layout
from pcd_engine.request import Request, in_order, rendered
from pcd_engine.results import PCDResult
from pcd_engine.rules import Rule, get_rule, tree_shape
from pcd_engine.runner import BranchRunner
from pcd_engine.schema import Limits
from pcd_engine.scorer import Scorer
from pcd_engine.shortlist import ShortlistPolicy
from pcd_engine.template_switches import read_switches
from pcd_engine.tool_calls import ToolCaller

T = TypeVar("T", bound=BaseModel)
DEFAULT_RULE = "option-boolcut-cc"  # chosen on the development sets; see docs/benchmarks.md (issue 35)
MAX_RENDERINGS = 8  # siblings kept by `rendered_with` (each holds its own plans)


class PCDEngine(LearningMixin, ChatMixin):
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

    Options: `rule` ("option-cc", "option", "option-mean", "option-unique", "option-unique-cc",
    "option-boolcut", "option-boolcut-cc", "greedy", "greedy-cc", "code" or a Rule object), `limits`,
    `chat_template_kwargs` (e.g. `{"enable_thinking": False}`), `instructions` (default system
    instructions), `max_tokens_per_forward` (tokens per forward call, which bounds microbatches and
    batched rows; default 2,048 on CPU, 32,768 on CUDA), `prefix_cache` (True, False or a shared
    `PrefixCache`: reuse the KV of the per-schema prompt head across calls), `allow_generation`
    (generate open fields; False raises UnsupportedSchemaError for them), `sampling` (default decoding
    for generation: greedy), `generation_batch_size` (rows per padded generation batch),
    `stop_token_ids` (end-of-answer ids; default: the model's eos ids and the chat template's
    end-of-turn token), `reference_model` (an FP32 copy of the weights: scored fields whose margin is
    below `rescore_margin` are scored again on it, so close calls match FP32), `self_check` (for a model
    not in float32: compare packed and separate passes on a fixed probe at start-up and raise
    PrecisionCheckError if they disagree; the report is `engine.precision_check`), `abstain_below`
    (default abstention threshold of `classify` calls; None: never abstain), `branch_wording` ("json": a
    branch continues the answer as a JSON object, `{"topic": "billing"}`; "plain": as a `topic: billing`
    line, the label after a space), `allow_empty_text` (classify empty or whitespace-only texts instead
    of refusing them with InputError), `text_framing` ("turn": the text is the whole user message;
    "data": between `<text>` delimiters, with a system sentence saying it is data, not instructions;
    "sandwich": "data" with the task restated after the text; docs/benchmarks.md measures the three
    against injected text), `shortlist` (True: `ShortlistPolicy.for_device`, or a `ShortlistPolicy`:
    where a second call pays, many-valued fields on cut trees first and their best values whole in it,
    and a tool's arguments only once it is chosen (gates.py); False: one pass over every tree),
    `pack_weights` (None: on a CPU where it is faster, timed once on the model's shapes, the model's
    linear layers are swapped in place for ones whose weights oneDNN lays out once, the same arithmetic
    (packed_weights.py: 1.25-1.45x faster on an AMD EPYC, slower on an Intel Xeon with MKL); True:
    wherever it applies; either way a model with grouped key/value heads reads them in place in
    attention (grouped_attention.py); False: the model is left as given)."""

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
        abstain_below: float | None = None,
        branch_wording: str = "json",
        allow_empty_text: bool = False,
        text_framing: str = "turn",
        shortlist: ShortlistPolicy | bool = True,
        pack_weights: bool | None = None,
    ) -> None:
        as_given = pack_weights is False
        if pack_weights is None:  # timed once, here: siblings get the answer through `_options`
            pack_weights = pays(model)
        if not as_given:  # on a CPU: the same arithmetic, faster (packed_weights.py)
            for each in (model, reference_model) if reference_model is not None else (model,):
                if pack_weights:
                    pack_linears(each)
                use_grouped_attention(each)
        self.model = model
        self.tokenizer = tokenizer
        # the options `rendered_with` builds siblings with
        self._options: dict[str, Any] = dict(
            rule=rule, limits=limits, instructions=instructions, allow_generation=allow_generation,
            max_tokens_per_forward=max_tokens_per_forward, sampling=sampling,
            generation_batch_size=generation_batch_size,
            stop_token_ids=stop_token_ids, rescore_margin=rescore_margin, abstain_below=abstain_below,
            branch_wording=branch_wording, allow_empty_text=allow_empty_text, text_framing=text_framing,
            shortlist=shortlist, pack_weights=pack_weights,
        )  # fmt: skip
        self._renderings: BoundedCache[str, PCDEngine] = BoundedCache(MAX_RENDERINGS)
        self._root = self
        self.rule = get_rule(rule)
        self.limits = limits or Limits()
        self.abstain_below = RequestOptions(abstain_below=abstain_below).abstain_below  # checks it
        self.sampling = sampling or Sampling()
        self.prompt = ChatPrompt(tokenizer, chat_template_kwargs, text_framing)
        self.runner = BranchRunner(model, max_tokens_per_forward)
        self.prefix_cache = prefix_cache if isinstance(prefix_cache, PrefixCache) else None
        if prefix_cache is True:
            self.prefix_cache = PrefixCache()
        self.scorer = Scorer(self.runner, self.prefix_cache, self.prompt)
        stops = stop_token_ids if stop_token_ids is not None else stop_ids(model, tokenizer, self.prompt)
        self.generator = Generator(model, tokenizer, stops, self.runner.cache_kw)
        self.filler = JsonFiller(self.generator, self.prompt, self.limits, self.scorer, generation_batch_size)
        self.rescorer: precision.FP32Rescorer | None = None
        if reference_model is not None:
            budget, cached = self.runner.max_tokens_per_forward, self.prefix_cache is not None
            self.rescorer = precision.FP32Rescorer(
                reference_model, rescore_margin, budget, cached, self.prompt
            )
        policy = ShortlistPolicy.for_device(self.runner.device) if shortlist is True else shortlist
        self.shortlist = policy or None
        plans = PlanCache(self.prompt, self.limits, self.filler.check, branch_wording, self.shortlist)
        self.pipeline = Pipeline(
            self.scorer, self.rescorer, plans, self.limits, self.rule, instructions, allow_generation,
            allow_empty_text,
        )  # fmt: skip
        self.precision_check: precision.SelfCheck | None = None
        precision.warn_if_emulated(self.runner.dtype, self.runner.device)
        if self_check and self.runner.dtype != torch.float32:
            probe = self.plan(precision.ProbeTicket, rule="option", allow_generation=False)
            self.precision_check = precision.self_check(self.runner, self.prompt, probe)
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
        manifest: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        **options: Any,
    ) -> PCDEngine:
        """Load a hub id (pin `revision`), a local folder, or a GGUF file, then build the engine.

        `dtype` is float32 unless asked otherwise. With `fp32_rescore=True` and a lower `dtype`, the
        weights are loaded in float32 and kept as the re-scoring reference beside a `dtype` copy that
        does the work (memory: both copies). A hub id downloads safetensors weights only. `manifest`
        (a `pcd manifest create` file or dict) is checked against the files before they load: a
        missing, changed or unlisted file raises ModelIntegrityError naming it.
        """
        model, tokenizer, reference = load_with_reference(
            name_or_path, revision, gguf_file, device, dtype, fp32_rescore, dict(model_kwargs or {}), manifest
        )
        if reference is not None:
            options["reference_model"] = reference
        return cls(model, tokenizer, **options)

    def rendered_with(self, chat_template_kwargs: Mapping[str, Any] | None) -> PCDEngine:
        """This engine with prompts rendered under other template switches, over its own:
        `engine.rendered_with({"enable_thinking": True})`. Switches the template does not read are
        ignored and bad ones raise InputError (`read_switches`); when none differs, the engine itself.
        Otherwise a sibling with the same model, tokenizer, prefix cache, reference weights and
        options, and its own prompt and plans (they hold rendered heads); the last `MAX_RENDERINGS`
        are kept. What `pcd serve` answers a request's `chat_template_kwargs` with."""
        prompt = self.prompt
        asked = read_switches(prompt.template, chat_template_kwargs or {}, prompt.control_strings)
        switches = {**prompt.template_kwargs, **asked}
        root = self._root
        if switches == root.prompt.template_kwargs:
            return root
        if switches == prompt.template_kwargs:
            return self

        def sibling() -> PCDEngine:
            reference = root.rescorer.runner.model if root.rescorer is not None else None
            cache = root.prefix_cache if root.prefix_cache is not None else False
            engine = PCDEngine(
                root.model, root.tokenizer, **root._options, chat_template_kwargs=switches,
                prefix_cache=cache, reference_model=reference, self_check=False,
            )  # fmt: skip
            engine.precision_check, engine._root = root.precision_check, root
            if engine.rescorer is not None and root.rescorer is not None:  # one FP32 prefix cache too
                engine.rescorer.scorer.prefix_cache = root.rescorer.scorer.prefix_cache
            return engine

        key = json.dumps(switches, sort_keys=True)
        return root._renderings.get_or_build(key, sibling)

    def plan(
        self, schema: Any, *, layout: str = "chat", shortlisted: bool = True, **options: Unpack[PlanOptions]
    ) -> SchemaPlan:
        """The cached SchemaPlan for a schema (compiled on first use; schema errors raise here):
        `Pipeline.plan`."""
        return self.pipeline.plan(schema, layout=layout, shortlisted=shortlisted, **options)

    @overload
    def classify(
        self, text: TextInput, schema: type[T], **options: Unpack[ClassifyOptions]
    ) -> PCDResult[T]: ...

    @overload
    def classify(
        self, text: TextInput, schema: Any, **options: Unpack[ClassifyOptions]
    ) -> PCDResult[Any]: ...

    def classify(self, text: TextInput, schema: Any, **options: Unpack[ClassifyOptions]) -> PCDResult[Any]:
        """Answer one text with a validated `schema` value and per-field results.

        `text` is a str, a `Conversation` or a `RawPrompt` (continued as written, no chat template).
        `schema` is a Pydantic model (gives an instance), a TypedDict or a JSON-schema dict (a dict).
        Closed fields are scored; open fields are generated unless `allow_generation=False`.
        The options (`ClassifyOptions`, each None by default: the engine's): `instructions`, `rule`,
        `allow_generation`, `examples` (labeled (text, answer) pairs put in the cached prompt head),
        `sampling`, `calibration` (a `Calibration` fitted for this schema, model and rule:
        `calibrate`), `abstain_below` (a field whose (calibrated) confidence is below it is marked
        abstained), `on_abstain` ("flag", or "raise": AbstentionError carrying the result) and
        `logprobs=k` (the generated tokens' log-probabilities, each with its `k` (0 to 20) most
        probable alternatives, in `result.token_logprobs`).
        """
        checked = RequestOptions.of(options, self.abstain_below)
        (result,) = self._run([text], schema, checked, return_exceptions=False, single=True)
        assert not isinstance(result, PCDError)
        return result

    def classify_batch(
        self,
        texts: Iterable[TextInput],
        schema: Any,
        *,
        calibrate: str | None = None,
        return_exceptions: bool = False,
        progress: Callable[[int], None] | None = None,
        **options: Unpack[ClassifyOptions],
    ) -> list[PCDResult[Any] | PCDError]:
        """Classify many texts; one entry per input, in order. Options as in `classify`.

        Every input is checked before any model work. With `return_exceptions=True`, an input that
        cannot be answered yields its `PCDError` in place and the others are still answered;
        otherwise the first such error is raised. `calibrate="batch"` calibrates every field on the
        batch itself (each value's probabilities divided by their mean over the batch): no labels
        needed, but it assumes the batch is not dominated by one value. Open fields are generated in
        padded batches of `generation_batch_size`. `progress(n)` is called as inputs complete.
        """
        if calibrate not in (None, "batch"):
            raise CalibrationError(f"calibrate must be None or 'batch', got {calibrate!r}")
        checked = RequestOptions.of(options, self.abstain_below, batch_calibration=calibrate == "batch")
        return self._run(list(texts), schema, checked, return_exceptions, single=False, progress=progress)

    def cache_sizes(self) -> dict[str, tuple[int, int]]:
        """(size, bound) of every cache keyed by what callers send: plans, tool plans, content-free
        priors and models built from JSON-schema dicts (entries), the prefix cache and xgrammar's
        compiled grammars (bytes). What `pcd serve` publishes on /metrics."""
        sizes = {
            "plans": (self.pipeline.plans.plans.size, self.pipeline.plans.plans.max_entries),
            "tool_plans": (self.tools.plans.size, self.tools.plans.max_entries),
            "priors": (self.scorer.priors_cache.size, self.scorer.priors_cache.max_entries),
            "json_schema_models": (DICT_MODELS.size, DICT_MODELS.max_entries),
            "grammar_bytes": (self.generator.grammar_cache_size, self.generator.grammar_cache_bytes),
            "renderings": (self._renderings.size, self._renderings.max_entries),
        }
        if self.prefix_cache is not None:
            sizes["prefix_bytes"] = (self.prefix_cache.nbytes, self.prefix_cache.max_bytes)
        return sizes

    def clear_caches(self) -> None:
        """Empty every cache `cache_sizes` lists (plans are built again on their next use)."""
        plans = self.pipeline.plans.plans
        for cache in (plans, self.tools.plans, self.scorer.priors_cache, DICT_MODELS, self._renderings):
            cache.clear()
        self.generator.clear_grammars()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @cached_property
    def tools(self) -> ToolCaller:
        """Tool calls scored like any closed field: `engine.tools.call(messages, tools)` (tools.py)."""
        return ToolCaller(self)

    @property
    def model_identity(self) -> ModelIdentity:
        """What calibrations fitted on this engine record and check (configuration, weight probe and
        the precision scores are computed in)."""
        return self.pipeline.model_identity

    @property
    def precision(self) -> str:
        """How scores are computed: the weights' dtype, and FP32 re-scoring of close calls if any."""
        return self.pipeline.precision

    def compare_rules(
        self, text: str, schema: type[T], rules: Sequence[str | Rule] = ("option", "option-mean", "greedy")
    ) -> dict[str, PCDResult[T]]:
        """Results of several rules that share one layout, all from the same packed pass."""
        chosen = [get_rule(r) for r in rules]
        if len({tree_shape(r) for r in chosen}) > 1:
            raise ValueError("these rules read different trees (codes, cut or not); compare them separately")
        plan = self.plan(schema, rule=chosen[0], allow_generation=False, shortlisted=False)
        return comparison.compare_rules(self.pipeline, plan, text, chosen)

    def _run(
        self,
        texts: Sequence[Any],
        schema: Any,
        options: RequestOptions,
        return_exceptions: bool,
        single: bool,
        progress: Callable[[int], None] | None = None,
    ) -> list[PCDResult[Any] | PCDError]:
        """The phases over the inputs, one plan per system text: a conversation's own system text
        goes before the call's instructions, so inputs with different ones are planned apart and
        answered in their order."""
        systems = system_texts(texts)
        groups = {
            system: [i for i, s in enumerate(systems) if s == system] for system in dict.fromkeys(systems)
        }
        if len(groups) <= 1:  # an empty batch too: its schema is still checked
            system = systems[0] if systems else None
            return self._run_plan(
                texts, schema, options.with_system(system), return_exceptions, single, progress
            )
        out: list[PCDResult[Any] | PCDError] = [None] * len(texts)  # type: ignore[list-item]
        for system, picked in groups.items():
            answered = self._run_plan(
                [texts[i] for i in picked], schema, options.with_system(system), return_exceptions, single,
                progress, picked,
            )  # fmt: skip
            for i, result in zip(picked, answered, strict=True):
                out[i] = result
        return out

    def _run_plan(
        self,
        texts: Sequence[Any],
        schema: Any,
        options: RequestOptions,
        return_exceptions: bool,
        single: bool,
        progress: Callable[[int], None] | None = None,
        numbers: Sequence[int] | None = None,
    ) -> list[PCDResult[Any] | PCDError]:
        target = output_type(schema)
        plan = self.pipeline.plan(target.model, layout=input_layout(texts), **options.plan)
        if options.calibration is not None:
            options.calibration.check(plan, self.model_identity)
        if options.batch_calibration and len(texts) < 2:
            raise CalibrationError("calibrate='batch' needs a batch of at least 2 texts")
        keep_hidden = options.calibration is not None and options.calibration.needs_hidden
        # 1. render every input: a bad one fails here (or takes its place), before any model work
        items = self.pipeline.render(plan, texts, single, return_exceptions, numbers)
        # 2. score the closed fields in packed passes, several requests per forward call
        self.pipeline.score(plan, items, keep_hidden, options.calibration, gated=True)
        # 3. re-score close calls on the FP32 reference model
        self.pipeline.rescore(plan, items)
        # 4. calibrate the scored fields, mark those below the abstention threshold
        batch, threshold = options.batch_calibration, options.abstain_below
        self.pipeline.apply_calibration(
            plan, items, options.calibration, batch=batch, abstain_below=threshold
        )
        # 5. the answer: the scored values alone, or with the open fields generated after them
        requests = rendered(items)
        if plan.json_schema is None:
            for item in items:
                if isinstance(item, Request):
                    item.validate_closed(plan)
                if progress is not None:
                    progress(1)
        else:
            sampling = options.sampling or self.sampling
            self.filler.fill(plan, requests, sampling, single, progress, options.logprobs)
            if progress is not None and len(requests) < len(items):
                progress(len(items) - len(requests))
        # 6. one result or error per input, in order
        return in_order(items, target.to_output, return_exceptions, options.on_abstain == "raise")
