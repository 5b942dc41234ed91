"""Open fields: generate the JSON object with the scored values already fixed, then parse and validate.

For one request: pin the scored values into the model's JSON schema (`json_schema.pinned_schema`), compile
it with xgrammar, write the forced JSON text (everything up to the first open value) after the prompt,
and let constrained generation continue. The answer is parsed and validated by the Pydantic model; a
validation error gets one retry with the error shown to the model, then `StructuredOutputError`.
`fill` does this for many requests, in padded batches of `batch_size` rows.

    >>> filler.job(plan, prompt_ids, closed={("topic",): "billing"})  # doctest: +SKIP
    FillJob(prompt=[...], forced='{"topic": "billing", "summary": ', ...)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from pcd_engine.decisions import scored_values
from pcd_engine.errors import StructuredOutputError, UnsupportedSchemaError
from pcd_engine.generate import GeneratedSequence, Generator, LogprobRecorder, Sampling
from pcd_engine.json_schema import Keys, check_enforceable, pinned_schema, token_budget
from pcd_engine.plan import SchemaPlan
from pcd_engine.prompt import ChatPrompt
from pcd_engine.request import Request, elapsed_ms
from pcd_engine.results import FieldResult
from pcd_engine.schema import Limits
from pcd_engine.scorer import Scorer

RETRY_TEXT = (
    "Your JSON answer was rejected by validation:\n{error}\n"
    "Reply again with one corrected JSON object for the same text."
)


@dataclass
class FillJob:
    prompt: list[int]  # prompt ids followed by the forced JSON text
    forced: str  # the JSON text written before generation (the scored values, the first open key)
    matcher: Any  # xgrammar matcher, already past `forced`
    budget: int  # max new tokens
    closed: Mapping[Keys, Any]


class JsonFiller:
    """Generates the open fields of requests whose closed fields are decided; the prompt head's KV
    comes from the scorer's prefix cache."""

    def __init__(
        self, generator: Generator, prompt: ChatPrompt, limits: Limits, scorer: Scorer, batch_size: int = 16
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"generation_batch_size must be >= 1, got {batch_size}")
        self.generator = generator
        self.prompt = prompt
        self.limits = limits
        self.scorer = scorer
        self.batch_size = batch_size

    def check(self, plan: SchemaPlan) -> None:
        """Compile the unpinned schema once, so an unsupported schema fails before any model work."""
        assert plan.json_schema is not None
        check_enforceable(plan.json_schema, plan.compiled.schema.__name__)
        try:
            self.generator.compile_json(json.dumps(plan.json_schema))
        except Exception as error:  # xgrammar raises RuntimeError/ValueError on schemas it cannot express
            raise UnsupportedSchemaError(
                plan.compiled.schema.__name__,
                plan.compiled.schema,
                f"its JSON schema cannot be turned into a grammar: {error}",
            ) from error

    def job(self, plan: SchemaPlan, prompt_ids: Sequence[int], closed: Mapping[Keys, Any]) -> FillJob:
        assert plan.json_schema is not None
        open_keys = [f.json_keys for f in plan.compiled.open_fields]
        pinned = pinned_schema(plan.json_schema, closed, open_keys)
        matcher = self.generator.matcher(self.generator.compile_json(json.dumps(pinned)))
        # Leave the space and opening quote before the first open value to the model: its own
        # tokens merge them with the value (` "Anna`); a lone trailing space token derails it.
        forced = matcher.find_jump_forward_string().removesuffix('"').rstrip(" ")
        if not matcher.accept_string(forced):
            raise RuntimeError(f"the grammar rejected its own forced text {forced!r}")
        budget = min(token_budget(pinned), self.limits.max_generated_tokens)
        ids = [*prompt_ids, *self.prompt.encode_text(forced)]
        return FillJob(ids, forced, matcher, budget, closed)

    def parse(self, job: FillJob, sequence: GeneratedSequence, model: type[BaseModel]) -> tuple[str, Any]:
        """(raw JSON text, validated instance or the ValidationError); raises when the budget ran out."""
        raw = job.forced + self.generator.tokenizer.decode(sequence.ids, skip_special_tokens=True)
        if sequence.finish_reason == "length":  # the grammar allows a stop token only once complete
            raise StructuredOutputError(
                f"generation used its whole budget of {job.budget} tokens (derived from the schema, "
                "at most Limits.max_generated_tokens) before the JSON object was complete",
                raw,
            )
        try:  # strict=False: a raw control character inside a generated string is data, not an error
            data = json.loads(raw, strict=False)
        except json.JSONDecodeError as error:
            message = f"generation did not produce valid JSON: {error}"
            raise StructuredOutputError(message, raw, error) from error
        for keys, value in job.closed.items():
            node = data
            for key in keys:
                node = node[key]
            if node != value:  # the grammar pins them: this would be a bug, never a model choice
                raise RuntimeError(f"generation changed the scored field {'.'.join(keys)}: {node!r}")
        try:
            return raw, model.model_validate(data)
        except ValidationError as error:
            return raw, error

    def retry_prompt(self, plan: SchemaPlan, text: str, raw: str, error: ValidationError) -> list[int]:
        messages = [
            ("system", plan.system),
            ("user", text),
            ("assistant", raw),
            ("user", RETRY_TEXT.format(error=_describe(error))),
        ]
        return self.prompt.render_messages(messages)

    def fill(
        self,
        plan: SchemaPlan,
        requests: Sequence[Request],
        sampling: Sampling,
        single: bool,
        progress: Callable[[int], None] | None = None,
        logprobs: int | None = None,
    ) -> None:
        """Generate the open fields of every request, in padded batches, with one retry each; a
        `single` request starts from the cached head. `logprobs=k` records the generated tokens'
        log-probabilities (k alternatives each) on the requests."""
        jobs = [
            self.job(plan, r.prompt.ids, plan.compiled.closed_values(scored_values(r.fields)))
            for r in requests
        ]
        for start in range(0, len(requests), self.batch_size):
            chunk = range(start, min(start + self.batch_size, len(requests)))
            began = time.perf_counter()
            kv = self._head_kv(plan, jobs[start].prompt, requests[start]) if single else None
            sequences = self.generator.run(
                [jobs[i].prompt for i in chunk],
                max_new_tokens=max(jobs[i].budget for i in chunk),
                sampling=sampling,
                matchers=[jobs[i].matcher for i in chunk],
                cache=kv,
                recorder=LogprobRecorder.asked(len(chunk), logprobs),
            )
            elapsed = elapsed_ms(began)
            for i, sequence in zip(chunk, sequences, strict=True):
                requests[i].timings["generate"] = elapsed
                self._finish(plan, requests[i], jobs[i], sequence, sampling, logprobs)
                if progress is not None:
                    progress(1)

    def _finish(
        self,
        plan: SchemaPlan,
        request: Request,
        job: FillJob,
        sequence: GeneratedSequence,
        sampling: Sampling,
        logprobs: int | None,
    ) -> None:
        """Parse and validate one generated answer; after a validation error, retry once."""
        for attempt in (1, 2):
            request.attempts = attempt
            request.generated_tokens += sequence.steps
            request.stats.forward_calls += sequence.steps
            try:
                raw, outcome = self.parse(job, sequence, plan.compiled.schema)
            except StructuredOutputError as error:
                error.attempts = attempt
                request.error = error
                return
            if isinstance(outcome, BaseModel):
                request.value = outcome
                request.fields.update(generated_fields(plan, outcome))
                if sequence.logprobs is not None:  # the accepted answer's tokens, as text
                    request.token_logprobs = self.generator.token_logprobs(sequence.logprobs)
                return
            if attempt == 2:
                request.error = StructuredOutputError(
                    "the generated object failed validation", raw, outcome, attempts=attempt
                )
                return
            began = time.perf_counter()
            job = self.job(plan, self.retry_prompt(plan, request.text, raw, outcome), job.closed)
            (sequence,) = self.generator.run(
                [job.prompt],
                max_new_tokens=job.budget,
                sampling=sampling,
                matchers=[job.matcher],
                cache=self._head_kv(plan, job.prompt, request),
                recorder=LogprobRecorder.asked(1, logprobs),
            )
            request.timings["retry"] = elapsed_ms(began)

    def _head_kv(self, plan: SchemaPlan, ids: Sequence[int], request: Request) -> Any:
        return self.scorer.generation_kv(ids, len(plan.head), request.stats)


def generated_fields(plan: SchemaPlan, value: BaseModel) -> dict[str, FieldResult]:
    """One FieldResult per open field, read from the validated object's JSON form."""
    data = value.model_dump(mode="json", by_alias=True)
    out = {}
    for f in plan.compiled.open_fields:
        node: Any = data
        for key in f.json_keys:
            node = node.get(key) if isinstance(node, dict) else None
        out[f.path] = FieldResult.generated(f.path, node)
    return out


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors(include_url=False):
        where = ".".join(str(p) for p in item["loc"]) or "<object>"
        lines.append(f"- {where}: {item['msg']}")
    return "\n".join(lines)
