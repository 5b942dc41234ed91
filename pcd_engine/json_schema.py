"""The JSON schema that constrains generation for models with open fields.

`pinned_schema` takes the model's own JSON schema (from Pydantic) and fixes every scored field to its
chosen value (`const`), moving the fixed properties first in each object: the grammar then forces them,
so generation cannot change a scored value, and the JSON text up to the first open value is known before
any model call (the engine writes it into the prompt). `capped` bounds every string and list, and
`token_budget` bounds the tokens any text valid under the schema may need, so generation always ends.

    >>> schema = {"type": "object", "required": ["note"], "properties": {
    ...     "note": {"type": "string", "maxLength": 20}, "topic": {"enum": ["a", "b"]}}}
    >>> list(pinned_schema(schema, {("topic",): "b"}, [("note",)])["properties"])
    ['topic', 'note']
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from pcd_engine.errors import UnsupportedSchemaError

Keys = tuple[str, ...]

DEFAULT_STRING_TOKENS = 256  # a string without maxLength
DEFAULT_ARRAY_ITEMS = 16  # an array without maxItems
NUMBER_TOKENS = 24
MAX_DEPTH = 8  # recursive models: below this depth a subschema counts as one default string
_OFFSET = r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_CLOCK = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](|[.][0-9]{1,6})"
# xgrammar's own grammars for these formats allow any number of fraction digits, so a model that keeps
# writing digits runs out of budget. These patterns stop at microseconds (what Python keeps), and their
# texts have a known longest length. Optional parts are written `(|...)`: xgrammar 0.2.9 reads
# `([.][0-9]{1,6})?` as if the dot were optional too (it accepts "4999Z" for seconds "49").
BOUNDED_FORMATS = {
    "date-time": (rf"^[0-9]{{4}}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T{_CLOCK}{_OFFSET}$", 32),
    "time": (rf"^{_CLOCK}(|{_OFFSET})$", 21),
}
_PATTERN_LENGTHS = dict(BOUNDED_FORMATS.values())


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """Pydantic's JSON schema of the model (validation mode); UnsupportedSchemaError when it has none."""
    try:
        return model.model_json_schema(mode="validation")
    except Exception as error:  # PydanticInvalidForJsonSchema, PydanticUserError
        raise UnsupportedSchemaError(
            model.__name__, model, f"it has no JSON schema, so it cannot be generated: {error}"
        ) from error


def capped(schema: Mapping[str, Any], max_string_length: int, max_items: int) -> dict[str, Any]:
    """A copy of `schema` in which every string without `maxLength` gets `max_string_length`, every
    array without `maxItems` gets `max_items`, and a `date-time` or `time` string a bounded pattern
    (BOUNDED_FORMATS): a looping model then ends a value instead of running out of budget, and the
    object still completes."""
    out = copy.deepcopy(dict(schema))
    _cap(out, max_string_length, max_items)
    return out


def _cap(node: Any, max_string_length: int, max_items: int) -> None:
    if isinstance(node, list):
        for item in node:
            _cap(item, max_string_length, max_items)
        return
    if not isinstance(node, dict):
        return
    kinds = node.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds and node.get("format") in BOUNDED_FORMATS and "pattern" not in node:
        node["pattern"] = BOUNDED_FORMATS[node.pop("format")][0]
    plain = not ({"enum", "const", "pattern", "format"} & node.keys())
    if "string" in kinds and plain and "maxLength" not in node:
        node["maxLength"] = max(max_string_length, node.get("minLength", 0))
    if "array" in kinds and "maxItems" not in node:
        node["maxItems"] = max(max_items, node.get("minItems", 0))
    for value in node.values():
        _cap(value, max_string_length, max_items)


def check_enforceable(schema: Mapping[str, Any], name: str) -> None:
    """UnsupportedSchemaError naming a keyword the grammar would drop without a word: xgrammar
    ignores `minLength`/`maxLength` beside a `pattern` or `format`, and `multipleOf` on a number
    (not an integer). Refused here rather than silently unenforced."""
    found = _unenforced(schema, "#")
    if found is not None:
        where, node, keyword, reason = found
        raise UnsupportedSchemaError(f"{name} {where}", node, f"its `{keyword}` {reason}")


def _unenforced(node: Any, where: str) -> tuple[str, dict[str, Any], str, str] | None:
    if isinstance(node, list):
        return next((f for i, n in enumerate(node) if (f := _unenforced(n, f"{where}/{i}"))), None)
    if not isinstance(node, dict):
        return None
    kinds = node.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    shaped = [k for k in ("pattern", "format") if k in node]
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    if shaped and lengths and "string" in kinds:
        fix = "write the length into the pattern (e.g. `{1,8}`) or drop one of them"
        return where, node, lengths[0], f"cannot be enforced beside `{shaped[0]}` by the grammar; {fix}"
    if "multipleOf" in node and "number" in kinds:
        return (
            where,
            node,
            "multipleOf",
            "cannot be enforced on a number by the grammar (on an integer it can)",
        )
    return next((f for key, value in node.items() if (f := _unenforced(value, f"{where}/{key}"))), None)


def resolve(node: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    """`node` with a local `$ref` (or a one-item `allOf`) replaced by the definition it names."""
    out = dict(node)
    for _ in range(MAX_DEPTH):
        if "$ref" in out:
            ref = out.pop("$ref")
            name = ref.rsplit("/", 1)[-1]
            out = {**defs[name], **out}
        elif isinstance(out.get("allOf"), list) and len(out["allOf"]) == 1:
            out = {**out.pop("allOf")[0], **out}
        else:
            return out
    return out


def field_schema(schema: Mapping[str, Any], keys: Keys) -> dict[str, Any]:
    defs = schema.get("$defs", {})
    node = resolve(schema, defs)
    for key in keys:
        node = resolve(node["properties"][key], defs)
    return node


def pinned_schema(
    schema: Mapping[str, Any], closed: Mapping[Keys, Any], open_keys: Sequence[Keys]
) -> dict[str, Any]:
    """The schema with every closed field fixed to its value and placed before its open siblings."""
    defs = schema.get("$defs", {})
    root = _pin(resolve(schema, defs), defs, closed, list(open_keys), ())
    if defs:
        root["$defs"] = copy.deepcopy(dict(defs))
    return root


def _pin(
    node: dict[str, Any],
    defs: Mapping[str, Any],
    closed: Mapping[Keys, Any],
    open_keys: Sequence[Keys],
    at: Keys,
) -> dict[str, Any]:
    properties = node.get("properties", {})
    fixed, rest = {}, {}
    for key, sub in properties.items():
        here = (*at, key)
        if here in closed:
            fixed[key] = {"const": closed[here]}
        elif any(k[: len(here)] == here for k in closed):  # a nested model with scored leaves
            pinned = _pin(resolve(sub, defs), defs, closed, open_keys, here)
            if any(k[: len(here)] == here for k in open_keys):
                rest[key] = pinned
            else:
                fixed[key] = pinned
        else:
            rest[key] = copy.deepcopy(sub)
    out = {k: v for k, v in node.items() if k not in ("properties", "required", "$defs")}
    out["properties"] = {**fixed, **rest}
    scored_inside = {key for key in rest if any(k[: len(at) + 1] == (*at, key) for k in closed)}
    out["required"] = [*fixed, *(k for k in rest if k in node.get("required", []) or k in scored_inside)]
    return out


def token_budget(schema: Mapping[str, Any], default_string_tokens: int = DEFAULT_STRING_TOKENS) -> int:
    """An upper bound on the tokens of compact JSON valid under `schema` (one token per character
    where the text is fixed, `maxLength` + 2 per string, defaults where the schema sets no bound)."""
    defs = schema.get("$defs", {})
    return _budget(schema, defs, 0, default_string_tokens)


def _budget(node: Mapping[str, Any], defs: Mapping[str, Any], depth: int, strings: int) -> int:
    node = resolve(node, defs)
    if depth > MAX_DEPTH:
        return strings
    if "const" in node:
        return len(json.dumps(node["const"])) + 1
    if "enum" in node:
        return max(len(json.dumps(v)) for v in node["enum"]) + 1
    for combinator in ("anyOf", "oneOf"):
        if combinator in node:
            return max(_budget(sub, defs, depth + 1, strings) for sub in node[combinator]) + 1
    kind = node.get("type")
    if isinstance(kind, list):
        return max(_budget({**node, "type": k}, defs, depth, strings) for k in kind)
    if kind == "object" or "properties" in node:
        props = node.get("properties", {})
        extra = 0 if props or not node.get("additionalProperties") else strings
        return (
            2
            + extra
            + sum(len(json.dumps(k)) + 3 + _budget(v, defs, depth + 1, strings) for k, v in props.items())
        )
    if kind == "array":
        items = node.get("items", {})
        count = node.get("maxItems", max(node.get("minItems", 0), DEFAULT_ARRAY_ITEMS))
        prefix = node.get("prefixItems", [])
        fixed = sum(_budget(p, defs, depth + 1, strings) + 2 for p in prefix)
        return 2 + fixed + count * (_budget(items, defs, depth + 1, strings) + 2)
    if kind == "string":
        if node.get("pattern") in _PATTERN_LENGTHS:
            return _PATTERN_LENGTHS[node["pattern"]] + 2
        return node["maxLength"] + 2 if "maxLength" in node else strings
    if kind in ("integer", "number"):
        return NUMBER_TOKENS
    if kind in ("boolean", "null"):
        return 5
    return strings  # any JSON value


def describe(node: Mapping[str, Any], defs: Mapping[str, Any]) -> str:
    """A short description of an open field for the system text, e.g. 'Text (at most 80 characters).'"""
    node = resolve(node, defs)
    options = node.get("anyOf") or node.get("oneOf")
    if options:
        kinds = [describe(o, defs).rstrip(".") for o in options]
        return " or ".join(kinds) + "."
    kind = node.get("type")
    if kind == "string":
        limit = f" (at most {node['maxLength']} characters)" if "maxLength" in node else ""
        return f"Text{limit}."
    if kind in ("integer", "number"):
        noun = "An integer" if kind == "integer" else "A number"
        low, high = node.get("minimum", node.get("exclusiveMinimum")), node.get("maximum")
        if high is None:
            high = node.get("exclusiveMaximum")
        if low is not None and high is not None:
            return f"{noun} from {low} to {high}."
        return f"{noun}."
    if kind == "array":
        return "A list of " + describe(node.get("items", {}), defs).rstrip(".").lower() + " values."
    if kind == "object" or "properties" in node:
        keys = ", ".join(json.dumps(k) for k in node.get("properties", {}))
        return f"An object with {keys}." if keys else "An object."
    if kind == "boolean":
        return "true or false."
    if kind == "null":
        return "null."
    if "enum" in node:
        return "One of: " + ", ".join(json.dumps(v) for v in node["enum"]) + "."
    return "Any JSON value."
