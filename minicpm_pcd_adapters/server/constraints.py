"""The constrained-decoding parameters of the servers MiniCPM5-2B users run today, read as one
`Constraint` (docs/migrating.md lists them beside what `pcd serve` does with each):

    vLLM 0.12+      structured_outputs: {choice | json | regex | grammar | json_object}
    vLLM < 0.12     guided_choice, guided_json, guided_regex, guided_grammar
                    (guided_decoding_backend, guided_whitespace_pattern: accepted and ignored)
    SGLang          regex, ebnf, json_schema
    llama.cpp       json_schema, grammar (GBNF)

A choice becomes a one-field schema scored whole (`choice_schema`), a JSON schema a structured
request; a regex or a grammar is generation constrained by xgrammar. `structural_tag` and two
constraints in one request are refused with a 400 that names them. Both request bodies (chat and
text completions) take these fields from `ConstrainedDecoding`.

    >>> read_constraint(ConstrainedDecoding(guided_choice=["yes", "no"]))
    Constraint(kind='choice', value=('yes', 'no'), param='guided_choice')
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from minicpm_pcd_adapters.server.errors import APIError
from pcd_engine import Grammar

CHOICE_FIELD = "choice"


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object (StructuredOutputsParams)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    choice: list[str] | None = None
    choices: list[str] | None = None  # the spelling of vLLM's own documented example
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    whitespace_pattern: str | None = None  # accepted, ignored: answers are compact JSON
    disable_fallback: bool | None = None  # accepted, ignored: one backend (xgrammar)
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None


class ConstrainedDecoding(BaseModel):
    """The request fields other servers read for constrained decoding."""

    model_config = ConfigDict(extra="forbid", strict=True)

    structured_outputs: StructuredOutputs | None = None
    guided_choice: list[str] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, ignored
    guided_whitespace_pattern: str | None = None  # accepted, ignored
    structural_tag: Any = None  # refused with a 400
    regex: str | None = None  # SGLang
    ebnf: str | None = None  # SGLang
    json_schema: dict[str, Any] | str | None = None  # SGLang, llama.cpp
    grammar: str | None = None  # llama.cpp (GBNF)


@dataclass(frozen=True)
class Constraint:
    """What the answer must be: a choice, a JSON schema, a regex, an EBNF grammar or any JSON object."""

    kind: str  # "choice", "json", "regex", "ebnf" or "json_object"
    value: Any  # the choices (a tuple), the schema (a dict), the pattern or grammar text, or None
    param: str  # the request parameter it came from (errors name it)

    def grammar(self) -> Grammar | None:
        """The grammar generation must match (None for a choice or a schema: those are scored)."""
        if self.kind == "regex":
            return Grammar.regex(self.value)
        if self.kind == "ebnf":
            return Grammar.ebnf(self.value)
        return Grammar.json_object() if self.kind == "json_object" else None


def read_constraint(request: ConstrainedDecoding) -> Constraint | None:
    """The one constraint a request asks for, or None; APIError (400) for `structural_tag`, for two
    constraints at once, or for a malformed one."""
    outputs = request.structured_outputs
    tags = {
        "structural_tag": request.structural_tag,
        "structured_outputs.structural_tag": outputs.structural_tag if outputs else None,
    }
    for param, value in tags.items():
        if value is not None:
            message = f"{param} is not supported by this server: use a JSON schema, a regex or a grammar"
            raise APIError(400, message, param=param, code="unsupported_parameter")
    found: list[tuple[str, str, Any]] = [  # (kind, param, value) of every parameter given
        ("choice", "guided_choice", request.guided_choice),
        ("json", "guided_json", request.guided_json),
        ("regex", "guided_regex", request.guided_regex),
        ("ebnf", "guided_grammar", request.guided_grammar),
        ("regex", "regex", request.regex),
        ("ebnf", "ebnf", request.ebnf),
        ("json", "json_schema", request.json_schema),
        ("ebnf", "grammar", request.grammar),
    ]
    if outputs is not None:
        found += [
            ("choice", "structured_outputs.choice", outputs.choice),
            ("choice", "structured_outputs.choices", outputs.choices),
            ("json", "structured_outputs.json", outputs.json_),
            ("regex", "structured_outputs.regex", outputs.regex),
            ("ebnf", "structured_outputs.grammar", outputs.grammar),
            ("json_object", "structured_outputs.json_object", outputs.json_object or None),
        ]
    given = [(kind, param, value) for kind, param, value in found if value is not None]
    if outputs is not None and not any(param.startswith("structured_outputs.") for _, param, _ in given):
        message = (
            "structured_outputs sets no constraint: give one of choice, json, regex, grammar, json_object"
        )
        raise APIError(400, message, param="structured_outputs", code="invalid_value")
    if len(given) > 1:
        first, second = given[0][1], given[1][1]
        message = f"conflicting constraints: {first} and {second}; give one"
        raise APIError(400, message, param=second, code="conflicting_parameters")
    if not given:
        return None
    kind, param, value = given[0]
    return Constraint(kind, _checked(kind, param, value), param)


def choice_schema(choices: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """The one-field schema a choice is scored as: `{"choice": one of the choices}`."""
    field = {"type": "string", "enum": list(choices)}
    return {
        "title": "Choice",
        "type": "object",
        "properties": {CHOICE_FIELD: field},
        "required": [CHOICE_FIELD],
    }


def schema_answer(schema: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """How a requested JSON schema is answered: None for `{}` (any JSON object: generated under
    xgrammar's JSON grammar); a root `enum` as a one-field schema scored whole, its answer the chosen
    value as JSON ("enum"); any other schema as itself ("json")."""
    if not schema:
        return None
    if "enum" in schema and "properties" not in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise APIError(400, "a root enum must list at least one value", code="invalid_value")
        field = {k: v for k, v in schema.items() if k in ("enum", "type", "description")}
        one_field = {"type": "object", "properties": {CHOICE_FIELD: field}, "required": [CHOICE_FIELD]}
        return {"title": schema.get("title", "Choice"), **one_field}, "enum"
    return schema, "json"


def _checked(kind: str, param: str, value: Any) -> Any:
    if kind == "choice":
        if not value or len(set(value)) != len(value):
            message = f"{param} must be a non-empty list of distinct strings, got {value!r:.200}"
            raise APIError(400, message, param=param, code="invalid_value")
        return tuple(value)
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise APIError(
                400, f"{param} is not valid JSON: {error}", param=param, code="invalid_value"
            ) from None
    if kind == "json" and not isinstance(value, dict):
        raise APIError(400, f"{param} must be a JSON schema object", param=param, code="invalid_value")
    if kind in ("regex", "ebnf") and not value.strip():
        raise APIError(400, f"{param} must not be empty", param=param, code="invalid_value")
    return value
