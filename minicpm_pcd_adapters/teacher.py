"""Labels from a stronger model: each text goes to an OpenAI-compatible endpoint (a hosted API, vLLM,
SGLang, another `pcd serve`) with the schema as a `response_format` json_schema, and the answer,
validated against the schema, is the text's label: the file `pcd calibrate` reads.

The official `openai` SDK does the talking: `chat.completions.parse` turns the Pydantic schema into
a strict JSON schema and validates the answer; at most `concurrency` requests are in flight, and the
SDK retries timeouts, 408, 409, 429, 5xx and lost connections with exponential backoff (honouring
`Retry-After`) up to `max_retries` times. A text that still fails, or whose answer does not
validate, gets a `TeacherError`: no text is dropped.

What the teacher knows of its answer is kept where it gives it: `pcd serve` returns every value's
probability per field (`probabilities`); other servers return token log-probabilities, from which
each top-level field's `confidence` is the probability of the tokens that wrote its value.

    >>> teacher = Teacher("http://127.0.0.1:8000/v1", "minicpm5-2b")  # doctest: +SKIP
    >>> labels = label_texts(teacher, Ticket, ["I was charged twice"])  # doctest: +SKIP
    >>> labels[0].label  # doctest: +SKIP
    {'topic': 'billing', 'urgent': True}
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

KEY_VARIABLE = "OPENAI_API_KEY"  # where the teacher's API key is read by default


@dataclass(frozen=True)
class Teacher:
    """An OpenAI-compatible endpoint and model; `api_key` None reads `KEY_VARIABLE` (a local server
    that needs no key gets a placeholder). `instructions`, if given, is sent as the system message."""

    base_url: str
    model: str
    api_key: str | None = None
    instructions: str | None = None
    concurrency: int = 8
    max_retries: int = 5
    timeout: float = 120.0
    logprobs: bool = True  # ask for token log-probabilities (confidence where there is no `pcd`)

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.max_retries < 0 or self.timeout <= 0:
            raise ValueError("concurrency must be at least 1, max_retries at least 0, timeout positive")

    def client(self) -> Any:
        from openai import AsyncOpenAI  # the [teacher] extra

        key = self.api_key or os.environ.get(KEY_VARIABLE) or "none"
        return AsyncOpenAI(
            base_url=self.base_url, api_key=key, max_retries=self.max_retries, timeout=self.timeout
        )


@dataclass(frozen=True)
class TeacherLabel:
    """The teacher's label of text `index` in the schema's JSON form, and what it said of its certainty."""

    index: int
    label: dict[str, Any]
    model: str  # the model name the endpoint answered with
    probabilities: dict[str, dict[str, float]] | None = None  # per field, per value (`pcd serve`)
    confidence: dict[str, float] | None = None  # per top-level field, from token log-probabilities

    def to_json(self) -> dict[str, Any]:
        teacher: dict[str, Any] = {"model": self.model}
        if self.probabilities is not None:
            teacher["probabilities"] = self.probabilities
        if self.confidence is not None:
            teacher["confidence"] = self.confidence
        return {"label": self.label, "teacher": teacher}


@dataclass(frozen=True)
class TeacherError:
    """Text `index` got no label: the last error, after the retries."""

    index: int
    type: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"error": {"type": self.type, "message": self.message}}


Answer = TeacherLabel | TeacherError


def label_texts(
    teacher: Teacher,
    schema: type[BaseModel],
    texts: Sequence[str],
    on_answer: Callable[[Answer], None] | None = None,
) -> list[Answer]:
    """One answer per text, in order; `on_answer` is called as each arrives (in arrival order)."""
    return asyncio.run(alabel_texts(teacher, schema, texts, on_answer))


async def alabel_texts(
    teacher: Teacher,
    schema: type[BaseModel],
    texts: Sequence[str],
    on_answer: Callable[[Answer], None] | None = None,
) -> list[Answer]:
    """`label_texts` in a running event loop."""
    client = teacher.client()
    gate = asyncio.Semaphore(teacher.concurrency)

    async def one(index: int, text: str) -> Answer:
        async with gate:
            answer = await _ask(client, teacher, schema, index, text)
        if on_answer is not None:
            on_answer(answer)
        return answer

    async with client:
        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(texts))))


async def _ask(client: Any, teacher: Teacher, schema: type[BaseModel], index: int, text: str) -> Answer:
    messages = [{"role": "user", "content": text}]
    if teacher.instructions:
        messages.insert(0, {"role": "system", "content": teacher.instructions})
    options: dict[str, Any] = {"logprobs": True, "top_logprobs": 1} if teacher.logprobs else {}
    try:
        completion = await client.chat.completions.parse(
            model=teacher.model, messages=messages, response_format=schema, temperature=0, **options
        )
    except Exception as error:  # after the SDK's retries (or an answer that does not validate): a record
        return TeacherError(index, type(error).__name__, str(error))
    choice = completion.choices[0]
    parsed = choice.message.parsed
    if parsed is None:
        why = choice.message.refusal or f"no answer (finish_reason {choice.finish_reason!r})"
        return TeacherError(index, "NoAnswer", why)
    label = parsed.model_dump(mode="json")
    extension = (choice.model_extra or {}).get("pcd")
    if isinstance(extension, dict) and isinstance(extension.get("fields"), dict):
        probabilities = {
            path: dict(field["probabilities"])
            for path, field in extension["fields"].items()
            if isinstance(field, dict) and field.get("probabilities")
        }
        return TeacherLabel(index, label, completion.model, probabilities=probabilities)
    content = choice.message.content or ""
    tokens = choice.logprobs.content if choice.logprobs is not None else None
    confidence = value_confidence(content, [(t.token, t.logprob) for t in tokens]) if tokens else None
    return TeacherLabel(index, label, completion.model, confidence=confidence)


def value_confidence(content: str, tokens: Sequence[tuple[str, float]]) -> dict[str, float] | None:
    """Per top-level key of the JSON object `content`, the probability of the tokens that wrote its
    value (a token counts when it overlaps the value's characters). None when the tokens do not spell
    `content` (a server that reports other tokens)."""
    if "".join(token for token, _ in tokens) != content:
        return None
    starts, position = [], 0
    for token, _ in tokens:
        starts.append(position)
        position += len(token)
    decoder = json.JSONDecoder()
    out: dict[str, float] = {}
    try:
        obj, _ = decoder.raw_decode(content.lstrip())
        if not isinstance(obj, dict):
            return None
        cursor = content.index("{") + 1
        for key in obj:
            at = content.index(json.dumps(key, ensure_ascii=False), cursor)  # the key as written
            at = content.index(":", at + len(json.dumps(key, ensure_ascii=False))) + 1
            while content[at].isspace():
                at += 1
            _, end = decoder.raw_decode(content, at)
            total = sum(
                logprob
                for start, (token, logprob) in zip(starts, tokens, strict=True)
                if start < end and start + len(token) > at
            )
            out[key] = math.exp(total)
            cursor = end
    except ValueError:  # keys written escaped, or not the object parsed: no confidence
        return None
    return out
