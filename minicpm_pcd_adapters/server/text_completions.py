"""The Completions protocol (`POST /v1/completions`) as `pcd serve` reads and writes it, as vLLM
serves it: `prompt` (a string or a list) is continued as written, with no chat template, so base
checkpoints answer too. No web framework and no model here.

`parse_completion(body, limits)` returns the same calls as chat (`calls.py`), with the
prompts as raw inputs:
- a `ClassifyCall` for a choice or a JSON schema (`server/constraints.py`, or `response_format`):
  every prompt of the list in one `classify_batch`, each answered right after its prompt;
- a `GenerateCall` otherwise (plain, regex, grammar or JSON-object generation).
The answers are written in this protocol's shape by `answers.py` (`TextCompletion`): `text` instead
of a message, and `logprobs` as `tokens`, `token_logprobs`, `top_logprobs` and `text_offset`. A list
of prompts answers with one choice per prompt (`n` each), in order.

    >>> call = parse_completion({"model": "m", "prompt": ["A", "B"]}, RequestLimits())
    >>> type(call).__name__, call.prompts, call.max_tokens
    ('GenerateCall', ('A', 'B'), 16)
"""

from __future__ import annotations

from typing import Any

from minicpm_pcd_adapters.server.calls import (
    ClassifyCall,
    GenerateCall,
    RequestLimits,
    refuse_beyond_limits,
    request_sampling,
    requested_schema,
)
from minicpm_pcd_adapters.server.constraints import (
    Constraint,
    choice_schema,
    read_constraint,
    schema_answer,
)
from minicpm_pcd_adapters.server.errors import APIError, read_body
from minicpm_pcd_adapters.server.protocol import DEFAULT_MAX_TOKENS, CompletionRequest
from pcd_engine import Grammar, RawPrompt


def parse_completion(body: Any, limits: RequestLimits) -> ClassifyCall | GenerateCall:
    """The call a Completions body asks for; APIError (400) for anything not honoured."""
    request = read_body(CompletionRequest, body)
    prompts = _prompts(request, limits)
    _refuse_unsupported(request, limits)
    constraint = _constraint(request)
    n, stream = request.n or 1, bool(request.stream)
    if request.stream_options is not None and not stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    usage = bool(request.stream_options and request.stream_options.include_usage)
    abstain = request.pcd.abstain_below if request.pcd else None
    sampling = request_sampling(request)
    logprobs = request.logprobs if request.logprobs is not None else request.n_probs
    scored = None
    if constraint is not None and constraint.kind == "choice":
        scored = (choice_schema(constraint.value), "choice")
    elif constraint is not None and constraint.kind == "json":
        scored = schema_answer(constraint.value)  # None: `{}`, any JSON object
    if constraint is not None and scored is not None:
        schema, answer = scored
        raw = tuple(RawPrompt(p, "value" if answer == "choice" else "json") for p in prompts)
        return ClassifyCall(
            request.model, schema, None, sampling, n, abstain, stream, usage, constraint.param,
            logprobs=logprobs, answer=answer, prompts=raw,
        )  # fmt: skip
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    grammar, param = (constraint.grammar(), constraint.param) if constraint else (None, None)
    if constraint is not None and constraint.kind == "json":  # `{}`
        grammar = Grammar.json_object()
    return GenerateCall(
        request.model, None, request.max_tokens or DEFAULT_MAX_TOKENS, stop, sampling, False, n, stream,
        usage, logprobs, grammar, param, tuple(prompts),
    )  # fmt: skip


def _prompts(request: CompletionRequest, limits: RequestLimits) -> list[str]:
    prompts = [request.prompt] if isinstance(request.prompt, str) else list(request.prompt)
    if not all(isinstance(p, str) for p in prompts):
        message = "prompt must be text (a string or a list of strings); token ids are not accepted"
        raise APIError(400, message, param="prompt", code="invalid_value")
    if not prompts:
        raise APIError(400, "prompt must not be an empty list", param="prompt", code="invalid_value")
    if len(prompts) > limits.max_prompts:
        message = f"prompt holds {len(prompts)} prompts, over this server's limit of {limits.max_prompts}"
        raise APIError(400, message, param="prompt", code="invalid_value")
    total = sum(len(str(p)) for p in prompts)
    if total > limits.max_text_chars:
        message = f"the prompts hold {total} characters, over this server's limit of {limits.max_text_chars}"
        raise APIError(400, message, param="prompt", code="string_above_max_length")
    return [str(p) for p in prompts]


def _refuse_unsupported(request: CompletionRequest, limits: RequestLimits) -> None:
    refused = {
        "suffix": "suffix (insertion) is not supported by this server",
        "echo": "echo is not supported by this server: the prompt is yours already",
    }
    for name, message in refused.items():
        if getattr(request, name):  # None, False, 0, "" and {} mean "not used"
            raise APIError(400, message, param=name, code="unsupported_parameter")
    n = request.n or 1
    if request.best_of not in (None, n):
        message = f"best_of must equal n ({n}) on this server: it keeps every sample it draws"
        raise APIError(400, message, param="best_of", code="unsupported_parameter")
    refuse_beyond_limits(request, limits, "max_tokens", request.max_tokens or 0)


def _constraint(request: CompletionRequest) -> Constraint | None:
    """The request's constraint: a vLLM, SGLang or llama.cpp parameter, or `response_format`."""
    constraint = read_constraint(request)
    format_ = request.response_format
    if format_ is None or format_.type == "text":
        return constraint
    if constraint is not None and constraint.kind != "json":
        message = f"conflicting constraints: response_format and {constraint.param}; give one"
        raise APIError(400, message, param=constraint.param, code="conflicting_parameters")
    asked = requested_schema(format_, constraint)  # the same schema twice is one; two differ: 400
    if asked is not None:
        return Constraint("json", asked[0], asked[1])
    return Constraint("json_object", None, "response_format")
