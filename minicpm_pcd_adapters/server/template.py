"""A request's template switches (`chat_template_kwargs`, Ollama's `think`), read against the served
chat template into a hashable part of the request's call: the engine renders the call's prompt with
them (`PCDEngine.rendered_with`), and calls with different switches never share a batch.

    >>> template = ChatTemplate("{% if enable_thinking %}<think>{% endif %}", {"enable_thinking": False})
    >>> template.switches({"enable_thinking": True, "add_vision_id": True})
    (('enable_thinking', True),)
    >>> template.switches({"enable_thinking": False})  # the served value: nothing to change
    ()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from minicpm_pcd_adapters.server.errors import APIError
from pcd_engine import InputError, PCDEngine, read_switches

Switches = tuple[tuple[str, Any], ...]  # sorted (name, value) pairs: booleans, numbers, null, strings


@dataclass(frozen=True)
class ChatTemplate:
    """The served chat template, the switches every prompt is rendered with unless a request sets
    others, and the control strings a switch's value may not hold."""

    text: str = ""
    served: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    control_strings: tuple[str, ...] = ()

    @classmethod
    def of(cls, engine: PCDEngine) -> ChatTemplate:
        prompt = engine.prompt
        return cls(prompt.template, dict(prompt.template_kwargs), tuple(prompt.control_strings))

    def reads(self, name: str) -> bool:
        """Whether the template reads the switch `name` (`think` needs `enable_thinking`)."""
        return bool(read_switches(self.text, {name: True}))

    def switches(self, asked: Mapping[str, Any] | None, param: str = "chat_template_kwargs") -> Switches:
        """The switches of `asked` the template reads and that differ from the served ones; a switch
        it does not read is ignored (as vLLM does); a bad one is a 400 naming it."""
        try:
            kept = read_switches(self.text, asked or {}, self.control_strings)
        except InputError as error:
            name = str(error).split(":", 1)[0]
            named = name if "." in name else param
            raise APIError(400, str(error), param=named, code="invalid_value") from None
        return tuple(sorted((k, v) for k, v in kept.items() if k not in self.served or self.served[k] != v))
