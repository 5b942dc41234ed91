"""What the model is asked: the system text that lists the fields, and each decision's branch.

A branch continues the assistant turn the way AR JSON would, as a one-field JSON object:
`{"shipping": {"method": ` followed by a candidate and the closing braces (`"air"}}`). The closing
braces are the terminator that makes candidates prefix-free (`1}` vs `10}`).

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
CODES = tuple(string.ascii_uppercase + string.ascii_lowercase + string.digits)


def branch_text(json_keys: Sequence[str]) -> str:
    return "".join("{" + json.dumps(k, ensure_ascii=False) + ": " for k in json_keys)


def candidate_text(json_value: str, depth: int) -> str:
    return json_value + "}" * depth


def code_candidates(candidates: Sequence[Candidate]) -> tuple[str, ...] | None:
    """JSON texts of the codes for a field's values, or None when codes do not apply."""
    if len(candidates) > len(CODES) or not any(isinstance(c.value, str) for c in candidates):
        return None
    return tuple(json.dumps(code) for code in CODES[: len(candidates)])


def system_text(
    compiled: CompiledSchema,
    instructions: str | None,
    codes: Mapping[int, Sequence[str]] | None = None,
) -> str:
    """The per-schema system message: instructions, the model's docstring, one line per field."""
    codes = codes or {}
    lines = [instructions or DEFAULT_INSTRUCTIONS]
    if compiled.description:
        lines.append(compiled.description)
    lines.append("")
    lines.append("Fields:")
    for index, f in enumerate(compiled.fields):
        lines.append(_field_line(f, codes.get(index)))
    if codes:
        lines.append("")
        lines.append("For a field listed with codes, write the code of the chosen value.")
    return "\n".join(lines)


def _field_line(f: ClosedField, codes: Sequence[str] | None) -> str:
    name = ".".join(json.dumps(k, ensure_ascii=False) for k in f.json_keys)
    described = f"- {name}" + (f": {f.description.strip()}" if f.description else "")
    return f"{described} {_allowed(f, codes)}"


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
