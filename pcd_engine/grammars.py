"""Grammars for constrained generation: what a generated text must match, compiled by xgrammar.

A `Grammar` names its kind and its source: a regular expression, an EBNF grammar (xgrammar reads the
GBNF dialect of llama.cpp too: `root ::= ...`), a JSON schema, or any JSON object. `generate` and
`stream` take one as `grammar=`; it is compiled (and cached by xgrammar's compiler) before any model
work, and a source that does not compile is an InputError that quotes xgrammar's reason. Closed
choices are not a grammar here: a choice is a schema field, scored whole by `classify`.

    >>> Grammar.regex(r"\\w+@\\w+\\.com").kind
    'regex'
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pcd_engine.errors import InputError

GRAMMAR_KINDS = ("regex", "ebnf", "json_schema", "json_object")


@dataclass(frozen=True)
class Grammar:
    kind: str  # one of GRAMMAR_KINDS
    source: str = ""  # the pattern, the grammar text or the schema's JSON; "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InputError(f"unknown grammar kind {self.kind!r}; choose one of {GRAMMAR_KINDS}")
        if not isinstance(self.source, str) or (self.kind != "json_object" and not self.source.strip()):
            raise InputError(f"a {self.kind} grammar needs a non-empty source string")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text that matches the regular expression whole."""
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> Grammar:
        """Text of the grammar's `root` rule (EBNF as xgrammar reads it, llama.cpp's GBNF included)."""
        return cls("ebnf", grammar)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        """One JSON value valid under the schema (compact separators)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(dict(schema)))

    @classmethod
    def json_object(cls) -> Grammar:
        """One JSON object with any keys (OpenAI's `json_object` response format)."""
        return cls("json_object")


def compile_grammar(compiler: Any, grammar: Grammar) -> Any:
    """xgrammar's CompiledGrammar for `grammar` on `compiler` (an xgrammar GrammarCompiler);
    InputError naming the kind when the source does not compile."""
    compact: dict[str, Any] = {"any_whitespace": False, "separators": (", ", ": ")}
    try:
        if grammar.kind == "regex":
            return compiler.compile_regex(grammar.source)
        if grammar.kind == "ebnf":
            return compiler.compile_grammar(grammar.source)
        if grammar.kind == "json_schema":
            return compiler.compile_json_schema(grammar.source, strict_mode=True, **compact)
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **compact)
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's parse errors
        lines = str(error).strip().splitlines() or [type(error).__name__]
        reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[-1])  # xgrammar's "[time] file:line: "
        raise InputError(f"the {grammar.kind} grammar cannot be compiled: {reason}") from None
