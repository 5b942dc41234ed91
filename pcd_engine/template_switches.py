"""Template switches: the variables a caller may set in the chat template (`enable_thinking`,
`reasoning_effort`), read once so that a prompt can be rendered per request without letting a request
write the template's control tokens.

A switch is kept when the template reads it (an undeclared variable of the template, found by Jinja's
own parser) and ignored otherwise, as vLLM does: a client may send MiniCPM5's `enable_thinking` to any
model. Refused with InputError, naming the switch: the renderer's own parameters and the special-token
variables (`messages`, `tools`, `add_generation_prompt`, `bos_token`, ...), and any value other than a
boolean, a number, null or a short string free of control strings (a switch is written by the template
itself, in its control-token part, so it is not data).

    >>> read_switches("{% if enable_thinking %}<think>{% endif %}", {"enable_thinking": True, "x": 1})
    {'enable_thinking': True}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from pcd_engine.errors import InputError

# What the renderer passes itself (apply_chat_template's parameters and the template's inputs).
RESERVED = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now",
    }
)  # fmt: skip
MAX_STRING = 64  # characters of a string switch (`reasoning_effort: "high"`)


def read_switches(
    template: str, asked: Mapping[str, Any], control_strings: Sequence[str] = ()
) -> dict[str, Any]:
    """The switches of `asked` that `template` reads, checked (InputError otherwise)."""
    if not isinstance(asked, Mapping):
        raise InputError(f"chat_template_kwargs must be an object, got {type(asked).__name__}")
    read = template_variables(template)
    kept = {}
    for key, value in asked.items():
        if not isinstance(key, str) or key in RESERVED or key.endswith("_token"):
            raise InputError(f"chat_template_kwargs.{key}: the renderer sets this variable itself")
        if key not in (read if read is not None else template):  # not read: ignored
            continue
        kept[key] = _checked(key, value, control_strings)
    return kept


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str] | None:
    """The variables `template` reads from its caller, by Jinja's parser; None when Jinja cannot parse
    it (a template with tags of its own), and the switches are then matched by name in its text."""
    import jinja2
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(meta.find_undeclared_variables(environment.parse(template)))
    except jinja2.TemplateError:
        return None


def _checked(key: str, value: Any, control_strings: Sequence[str]) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    if not isinstance(value, str):
        raise InputError(
            f"chat_template_kwargs.{key}: a switch is a boolean, a number, null or a string, "
            f"got {type(value).__name__}"
        )
    if len(value) > MAX_STRING:
        raise InputError(f"chat_template_kwargs.{key}: a string switch holds at most {MAX_STRING} characters")
    found = [c for c in control_strings if c in value]
    if found:
        raise InputError(f"chat_template_kwargs.{key}: the value contains the control token {found[0]!r}")
    return value
