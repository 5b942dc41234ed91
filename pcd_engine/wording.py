"""What the model is asked: the system text that lists the fields, and each decision's branch.

A branch continues the assistant turn the way AR JSON would, as a one-field JSON object:
`{"shipping": {"method": ` followed by a candidate and the closing braces (`"air"}}`). The closing
braces are the terminator that makes candidates prefix-free (`1}` vs `10}`). The "plain" wording
writes `shipping.method:` followed by ` air` and a newline instead (a label then starts with a
space, as a word does in running text); docs/benchmarks.md compares the two. After a raw prompt
(`RawPrompt(answer="value")`, vLLM's `choice`) the "value" wording writes the value's text alone.

With codes (the `code` rule) a string field lists its values under single-token codes and the
candidates become `"A"}`, `"B"}`, ...

    >>> branch_text(("shipping", "method"))
    '{"shipping": {"method": '
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence

from pcd_engine.schema import Candidate, ClosedField, CompiledSchema

DEFAULT_INSTRUCTIONS = (
    "Classify the text in the user's message. Reply with one JSON object with the fields below, "
    "choosing each value only from the allowed ones."
)
MIXED_INSTRUCTIONS = (
    "Answer from the text in the user's message. Reply with one JSON object with the fields below; "
    "where allowed values are listed, choose only from them."
)
CODES = tuple(string.ascii_uppercase + string.ascii_lowercase + string.digits)


WORDINGS = ("json", "plain")
PLAIN_INSTRUCTIONS = (
    "Classify the text in the user's message. Reply with one line per field below, as `field: value`, "
    "choosing each value only from the allowed ones."
)


def branch_text(json_keys: Sequence[str], wording: str = "json") -> str:
    if wording == "value":  # a raw prompt's `choice`: the value right after the prompt
        return ""
    if wording == "plain":
        return ".".join(json_keys) + ":"
    return "".join("{" + json.dumps(k, ensure_ascii=False) + ": " for k in json_keys)


def candidate_text(json_value: str, depth: int, wording: str = "json") -> str:
    if wording == "value":
        value = json.loads(json_value)
        return value if isinstance(value, str) else json_value
    if wording == "plain":
        return " " + plain_value(json.loads(json_value)) + "\n"
    return json_value + "}" * depth


def plain_value(value: object) -> str:
    """A value as the plain wording writes it: strings without quotes (escaped as in JSON, so a
    newline cannot end the line early), other values as JSON."""
    text = json.dumps(value, ensure_ascii=False)
    return text[1:-1] if isinstance(value, str) else text


def plain_answer(compiled: CompiledSchema, answer: str) -> str:
    """An example's answer JSON in the plain wording: one `field: value` line per decision."""
    data = json.loads(answer)
    lines = []
    for d in compiled.decisions:
        node = data
        keys = d.json_keys[:-1] if d.option is not None else d.json_keys
        for key in keys:
            node = node[key]
        value = d.option in node if d.option is not None else node
        lines.append(f"{'.'.join(d.json_keys)}: {plain_value(value)}")
    return "\n".join(lines)


def code_candidates(candidates: Sequence[Candidate]) -> tuple[str, ...] | None:
    """JSON texts of the codes for a field's values, or None when codes do not apply."""
    if len(candidates) > len(CODES) or not any(isinstance(c.value, str) for c in candidates):
        return None
    return tuple(json.dumps(code) for code in CODES[: len(candidates)])


def system_text(
    compiled: CompiledSchema,
    instructions: str | None,
    codes: Mapping[int, Sequence[str]] | None = None,
    open_allowed: Mapping[str, str] | None = None,
    wording: str = "json",
) -> str:
    """The per-schema system message: instructions, the model's docstring, one line per field.

    `open_allowed` describes each open field's values by path (e.g. "Text."); fields are listed in
    declaration order, closed and open alike.
    """
    codes = codes or {}
    default = DEFAULT_INSTRUCTIONS if wording == "json" else PLAIN_INSTRUCTIONS
    lines = [instructions or (default if not compiled.open_fields else MIXED_INSTRUCTIONS)]
    if compiled.description:
        lines.append(compiled.description)
    lines.append("")
    lines.append("Fields:")
    closed = {f.path: (index, f) for index, f in enumerate(compiled.fields)}
    opened = {f.path: f for f in compiled.open_fields}
    for path in compiled.order or list(closed):
        if path in closed:
            index, f = closed[path]
            lines.append(_field_line(f, codes.get(index)))
        else:
            o = opened[path]
            lines.append(
                f"{_described(o.json_keys, o.description)} {(open_allowed or {}).get(path, '')}".rstrip()
            )
    if codes:
        lines.append("")
        lines.append("For a field listed with codes, write the code of the chosen value.")
    return "\n".join(lines)


def _field_line(f: ClosedField, codes: Sequence[str] | None) -> str:
    return f"{_described(f.json_keys, f.description)} {_allowed(f, codes)}"


def _described(json_keys: Sequence[str], description: str | None) -> str:
    name = ".".join(json.dumps(k, ensure_ascii=False) for k in json_keys)
    return f"- {name}" + (f": {description.strip()}" if description else "")


def _allowed(f: ClosedField, codes: Sequence[str] | None) -> str:
    values = [c.value for c in f.candidates]
    shown = [c.json for c in f.candidates]
    if f.multi_label:
        return "An object with true or false for each of: " + ", ".join(shown) + " (true if it applies)."
    if codes:
        pairs = [f"{json.loads(code)} = {text}" for code, text in zip(codes, shown, strict=True)]
        return "Codes: " + ", ".join(pairs) + "."
    if sorted(values, key=repr) == [False, True]:
        return "true or false."
    ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    if len(ints) == len(values) > 2 and ints == list(range(ints[0], ints[-1] + 1)):
        return f"An integer from {ints[0]} to {ints[-1]}."
    return "One of: " + ", ".join(shown) + "."
