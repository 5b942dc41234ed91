"""What both adapters (LangChain, LlamaIndex) make of a call: the engine's request and sampling.

Each adapter first reduces its message objects to (role, text) pairs; this module decides what the
engine is asked: system messages become the instructions that head the schema's field list, the rest
becomes the text to answer. Decoding options come from `Sampling`'s fields, per call or per adapter.

    >>> structured_request([("system", "Route it."), ("user", "I was charged twice")])
    ('Route it.', 'I was charged twice')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pcd_engine import Sampling, ToolCallResult

SAMPLING_OPTIONS = frozenset(f.name for f in dataclasses.fields(Sampling))


def sampling_for(adapter: Any, overrides: Mapping[str, Any]) -> Sampling:
    """Decoding options: each `Sampling` field from the per-call `overrides`, else the adapter's
    field of that name, else Sampling's default."""
    return Sampling(
        **{
            f.name: overrides.get(f.name, getattr(adapter, f.name, f.default))
            for f in dataclasses.fields(Sampling)
        }
    )


def structured_request(messages: Sequence[tuple[str, str]]) -> tuple[str | None, str]:
    """(instructions, text): one user message is the text as it is; a longer conversation becomes
    'Role: content' paragraphs."""
    system = [text for role, text in messages if role == "system"]
    rest = [(role, text) for role, text in messages if role != "system"]
    if len(rest) == 1 and rest[0][0] == "user":
        text = rest[0][1]
    else:
        text = "\n\n".join(f"{role.title()}: {content}" for role, content in rest)
    return ("\n\n".join(system) or None), text


def decide_tools(
    adapter: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Any,
    tool_choice: Any,
    options: Mapping[str, Any],
) -> ToolCallResult:
    """A tool decision as both adapters ask for it: the messages as role/content dicts, the adapter's
    tool calibration and abstention threshold, the call's `max_tokens` and `sampling`."""
    return adapter.load().tools.call(
        messages,
        tools,
        tool_choice=tool_choice,
        calibration=adapter.tool_calibration,
        abstain_below=adapter.abstain_below,
        max_tokens=options["max_tokens"],
        sampling=options["sampling"],
    )
