"""One exception root for everything the engine raises on purpose.

Every error says what was wrong, where (field path or input index) and what to do instead.
"""

from __future__ import annotations

from typing import Any

# A leaf: this module imports nothing of the package, so every module may import it. The report and
# result that two errors carry are typed `Any` here (precision.SelfCheck, results.PCDResult).


class PCDError(Exception):
    """Root of all errors raised by pcd_engine."""


class UnsupportedSchemaError(PCDError, TypeError):
    """A schema field has a type the engine cannot score.

    Raised at compile time, before any model work, naming the field path, its type, why it is
    unsupported and which types are supported.
    """

    def __init__(self, path: str, annotation: object, reason: str) -> None:
        self.path = path
        self.annotation = annotation
        self.reason = reason
        super().__init__(
            f"field {path!r} of type {_type_name(annotation)} cannot be scored: {reason}. "
            f"Supported closed types: {SUPPORTED_TYPES}."
        )


class SchemaLimitError(PCDError, ValueError):
    """A schema exceeds a configured limit (fields, candidates, tokens per candidate)."""

    def __init__(self, what: str, value: int, limit: int, where: str, option: str) -> None:
        self.what = what
        self.value = value
        self.limit = limit
        self.where = where
        super().__init__(
            f"{where}: {value} {what} exceeds the limit of {limit}; "
            f"raise it with Limits({option}=...) or simplify the schema."
        )


class InputError(PCDError, ValueError):
    """An input text cannot be classified (wrong type, empty, or its prompt is too long)."""


class TokenizationError(PCDError, ValueError):
    """A field's values, as this tokenizer writes them, cannot be told apart by scoring: one value's
    tokens begin another's, or the values share no first token after the field's key. Raised when
    the schema is planned, before any text is read; reword or drop the value it names."""


class StructuredOutputError(PCDError, ValueError):
    """The model's answer could not be turned into a valid object (after the allowed retries).

    `raw` is the last JSON text produced, `error` the validation error (or the reason, such as the token
    budget running out) and `attempts` the number of generations tried.
    """

    def __init__(self, message: str, raw: str, error: object = None, attempts: int = 1) -> None:
        self.raw = raw
        self.error = error
        self.attempts = attempts
        super().__init__(f"{message} (after {attempts} attempt(s)); raw output: {raw[:500]!r}")


class PrecisionCheckError(PCDError, RuntimeError):
    """The packed path disagrees with separate forward passes in the model's dtype (`check` is the
    precision.SelfCheck report)."""

    def __init__(self, check: Any) -> None:
        self.check = check
        super().__init__(
            f"self-check failed in {check.dtype}: packed and separate forward passes differ by up to "
            f"{check.max_abs_diff:.4g} nats (tolerance {check.tolerance:g}), decisions agree: "
            f"{check.decisions_agree}. Load the model in float32, or pass self_check=False to accept it."
        )


class CalibrationError(PCDError, ValueError):
    """A calibration cannot be fitted, loaded or applied (bad labels, too few texts, or it was fitted
    for another schema, model or rule)."""


class AbstentionError(PCDError):
    """A field's calibrated confidence is below the abstention threshold and `on_abstain="raise"` was
    asked; `result` is the full answer (its abstained fields are marked) for review."""

    def __init__(self, result: Any) -> None:
        self.result = result
        unsure = ", ".join(f"{p!r} ({result.fields[p].confidence:.2f})" for p in result.abstained_fields)
        super().__init__(f"abstained on field(s) {unsure}: confidence below the threshold; review the answer")


class ModelLoadError(PCDError, OSError):
    """A model or tokenizer could not be loaded (hub unreachable, missing file, bad folder)."""


class ModelIntegrityError(ModelLoadError):
    """A model file does not match its manifest (missing, changed, or not listed). `file` names it."""

    def __init__(self, message: str, file: str) -> None:
        super().__init__(message)
        self.file = file


SUPPORTED_TYPES = (
    "Literal[...] of str/int/bool, bool, Enum with str or int values, Optional[<closed>], "
    "nested BaseModel whose leaves are closed, list[Literal]/set[Literal] (multi-label), "
    "Annotated[int, Field(ge=.., le=..)] (bounded int)"
)


def _type_name(annotation: object) -> str:
    name = getattr(annotation, "__name__", None)
    return name if isinstance(name, str) and "[" not in repr(annotation) else repr(annotation)
