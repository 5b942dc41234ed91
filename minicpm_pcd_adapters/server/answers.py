"""OpenAI Chat Completions answers as `pcd serve` writes them: completion and chunk objects, usage,
structured answers with the `pcd` extension and standard `logprobs`. No web framework, no model."""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from minicpm_pcd_adapters.server.completions import text_body, text_chunk
from minicpm_pcd_adapters.server.constraints import CHOICE_FIELD
from minicpm_pcd_adapters.server.protocol import ClassifyCall, ToolCall
from pcd_engine import FieldResult, Generation, PCDResult, TokenLogprob, ToolCallResult


@dataclass
class Completion:
    """One response: its id, creation time and model, then its choices (one per `n`). With `text`,
    written as a `/v1/completions` answer (`server/completions.py`)."""

    model: str
    text: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or ("cmpl-" if self.text else "chatcmpl-") + secrets.token_hex(12)

    def body(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        if self.text:
            return text_body(self.id, self.created, self.model, choices, usage)
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
            "system_fingerprint": None,
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if usage is not None:
            out["usage"] = usage
        return text_chunk(out) if self.text else out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def classified_message(call: ClassifyCall, result: PCDResult[Any], index: int) -> dict[str, Any]:
    """The assistant message (`content`, or one `tool_calls` entry) and the `pcd` extension."""
    answer = result.to_json()
    arguments = json.dumps(answer["value"], ensure_ascii=False)
    if call.answer == "choice":  # vLLM's `choice`: the chosen string alone
        message: dict[str, Any] = {
            "role": "assistant",
            "content": answer["value"][CHOICE_FIELD],
            "refusal": None,
        }
    elif call.tool is None:
        message = {"role": "assistant", "content": arguments, "refusal": None}
    else:
        message = {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [
                {
                    "id": f"call_{secrets.token_hex(12)}",
                    "type": "function",
                    "function": {"name": call.tool, "arguments": arguments},
                }
            ],
        }
    d = result.diagnostics
    extension = {
        "fields": answer["fields"],
        "needs_review": result.needs_review,
        "abstained_fields": result.abstained_fields,
        "forward_calls": d.forward_calls,
        "cached_tokens": d.cached_tokens,
    }
    finish = "stop" if call.tool is None else "tool_calls"
    fields = list(result.fields.values())
    as_text = call.answer == "choice"
    logprobs = (
        None
        if call.logprobs is None
        else scored_logprobs(fields, result.token_logprobs, call.logprobs, as_text)
    )
    return {
        "index": index,
        "message": message,
        "finish_reason": finish,
        "logprobs": logprobs,
        "pcd": extension,
    }


def tool_message(call: ToolCall, result: ToolCallResult, index: int) -> dict[str, Any]:
    """The choice of a tool decision: one `tool_calls` entry, or the text answer; `pcd` holds the
    decision's probabilities (every tool's, "" for the text answer) and the scored arguments."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text, "refusal": None}
    if result.tool is not None:
        arguments = json.dumps(result.arguments or {}, ensure_ascii=False)
        function = {"name": result.tool, "arguments": arguments}
        message["tool_calls"] = [
            {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": function}
        ]
    extension = result.to_json()
    extension["probabilities"] = {k if k is not None else "": p for k, p in result.probabilities.items()}
    decided = [result.decision] if result.decision is not None else []
    fields = [*decided, *result.fields.values()]
    logprobs = None if call.logprobs is None else scored_logprobs(fields, result.logprobs, call.logprobs)
    return {
        "index": index,
        "message": message,
        "finish_reason": result.finish_reason,
        "logprobs": logprobs,
        "pcd": extension,
    }


def scored_logprobs(
    fields: Sequence[FieldResult], generated: Sequence[TokenLogprob] | None, top: int, as_text: bool = False
) -> dict[str, Any]:
    """OpenAI's `choice.logprobs` for a structured answer or a tool decision. First, per scored
    field in answer order, one entry whose `token` is the chosen value as written in the JSON answer
    and whose `logprob` is the log of its (calibrated) probability; `top_logprobs` lists the field's
    `top` most probable values, most probable first. Then the generated tokens (the open fields'
    JSON text after the scored values, or a text answer), each with the model's log-probability and
    its `top` alternatives. `as_text`: string values written as themselves (a `choice` answer), not
    as JSON."""

    def entry(value: Any, p: float) -> dict[str, Any]:
        written = value if as_text and isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return _entry(written, math.log(p) if p > 0 else -9999.0)

    content = []
    for f in fields:
        if f.source != "scored":
            continue
        ranked = sorted(f.probabilities.items(), key=lambda kv: -kv[1])[:top]
        content.append(
            {**entry(f.value, f.probabilities[f.value]), "top_logprobs": [entry(v, p) for v, p in ranked]}
        )
    return {"content": content + token_logprobs(generated or (), top)["content"], "refusal": None}


def token_logprobs(tokens: Sequence[TokenLogprob], top: int) -> dict[str, Any]:
    """OpenAI's `logprobs` object for generated tokens, with at most `top` alternatives each."""
    content = [
        {**_entry(t.token, t.logprob), "top_logprobs": [_entry(text, p) for text, p in t.top[:top]]}
        for t in tokens
    ]
    return {"content": content, "refusal": None}


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": max(logprob, -9999.0), "bytes": list(token.encode())}


def classified_usage(results: list[PCDResult[Any]], n: int = 1) -> dict[str, Any]:
    """Usage of answers given `n` per input: each input's prompt counted once."""
    d = [r.diagnostics for r in results]
    prompt, cached = sum(x.prompt_tokens for x in d[::n]), sum(x.cached_tokens for x in d[::n])
    return usage(prompt, sum(x.generated_tokens for x in d), cached)


def generated_choice(answer: Generation, index: int, top: int | None = None) -> dict[str, Any]:
    """A plain chat choice; with `top` (not None), its tokens' `logprobs` with `top` alternatives."""
    message = {"role": "assistant", "content": answer.text, "refusal": None}
    logprobs = None if answer.logprobs is None or top is None else token_logprobs(answer.logprobs, top)
    return {"index": index, "message": message, "finish_reason": answer.finish_reason, "logprobs": logprobs}


def choice_delta(index: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """One choice of a stream chunk."""
    return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


def delta_chunks(message: dict[str, Any], index: int) -> list[dict[str, Any]]:
    """A whole message as stream deltas: the role, then the content or the tool call."""
    if message.get("tool_calls"):
        delta: dict[str, Any] = {"tool_calls": [{"index": 0, **message["tool_calls"][0]}]}
    else:
        delta = {"content": message["content"]}
    return [choice_delta(index, {"role": "assistant", "content": ""}), choice_delta(index, delta)]
