"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes: a prompt's or a conversation's token ids
exactly as the engine would feed them, and ids back to text. A prompt is tokenized as data (a control
string in it stays text: the engine never lets user text become a control token), after the tokenizer's
BOS when `add_special_tokens`; chat `messages` are read by the chat door's converter and rendered by the
engine's one conversation rendering, up to the assistant's start, so the count is a chat request's
prompt tokens.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from minicpm_pcd_adapters.server.calls import RequestLimits, conversation_of
from minicpm_pcd_adapters.server.errors import APIError, read_body
from minicpm_pcd_adapters.server.jobs import json_body
from minicpm_pcd_adapters.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    dump,
)
from minicpm_pcd_adapters.server.template import ChatTemplate
from pcd_engine import InputError, PCDEngine


class TokenEndpoints:
    """`/tokenize` and `/detokenize` on the engine's tokenizer (off the event loop: a long prompt or
    template takes a while)."""

    def __init__(self, engine: PCDEngine, model_name: str, limits: RequestLimits) -> None:
        self.engine, self.model_name, self.limits = engine, model_name, limits
        self.template = ChatTemplate.of(engine)
        self.vocabulary = len(engine.tokenizer)

    async def tokenize(self, request: Request) -> dict[str, Any]:
        asked = read_body(TokenizeRequest, await json_body(request))
        self._check_model(asked.model)
        if (asked.prompt is None) == (asked.messages is None):
            message = "give either prompt or messages"
            raise APIError(400, message, param="prompt", code="invalid_value")
        ids = await asyncio.to_thread(self._ids, asked)
        strings = (
            await asyncio.to_thread(self.engine.prompt.token_strings, ids)
            if asked.return_token_strs
            else None
        )
        answer = TokenizeResponse(
            count=len(ids), max_model_len=self.engine.limits.max_prompt_tokens, tokens=ids, token_strs=strings
        )
        return dump(answer)

    async def detokenize(self, request: Request) -> dict[str, Any]:
        asked = read_body(DetokenizeRequest, await json_body(request))
        self._check_model(asked.model)
        for index, token in enumerate(asked.tokens):
            if not 0 <= token < self.vocabulary:
                message = f"token id {token} is not in the vocabulary (0 to {self.vocabulary - 1})"
                raise APIError(400, message, param=f"tokens.{index}", code="invalid_value")
        return dump(
            DetokenizeResponse(prompt=await asyncio.to_thread(self.engine.prompt.decode, asked.tokens))
        )

    def _ids(self, asked: TokenizeRequest) -> list[int]:
        prompt = self.engine.prompt
        if asked.prompt is not None:
            if len(asked.prompt) > self.limits.max_text_chars:
                message = f"the prompt holds {len(asked.prompt)} characters, over this server's limit"
                raise APIError(400, message, param="prompt", code="string_above_max_length")
            head = prompt.raw_head if asked.add_special_tokens else ()
            return [*head, *prompt.encode_text(asked.prompt)]
        if not asked.add_generation_prompt:
            message = "add_generation_prompt: false is not supported: chat is rendered up to the answer"
            raise APIError(400, message, param="add_generation_prompt", code="unsupported_parameter")
        assert asked.messages is not None
        switches = self.template.switches(asked.chat_template_kwargs)
        conversation = conversation_of(asked.messages, self.limits)
        tools = [t.model_dump(exclude_none=True) for t in asked.tools or []]
        try:
            prompt = self.engine.rendered_with(dict(switches)).prompt
            return list(prompt.render_conversation(conversation.system, conversation, tools))
        except InputError as error:
            raise APIError(400, str(error), param="messages", code="invalid_input") from None
        except Exception as error:  # jinja2 TemplateError: roles the template rejects, bad order
            message = f"the chat template rejected the messages: {error}"
            raise APIError(400, message, param="messages", code="invalid_input") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            message = f"the model {model!r} does not exist; this server serves {self.model_name!r}"
            raise APIError(404, message, param="model", code="model_not_found")
