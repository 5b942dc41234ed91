"""Plain chat generation: a conversation in, checked options, stop ids, answers.

`chat_call` checks everything a `generate` / `stream` call was given and renders its prompt, so that a
bad call fails with InputError before any model work; the `ChatCall` then runs on the generator,
whole (`Generation`) or streamed (`GenerationChunk`s, stop strings held back until they cannot start).
The messages become a `Conversation` (conversation.py) and are rendered as every door renders them
(`ChatPrompt.render_conversation`).
"""

from __future__ import annotations

import collections.abc
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from typing_extensions import Unpack

from pcd_engine.conversation import Conversation
from pcd_engine.errors import InputError
from pcd_engine.generate import (
    GeneratedSequence,
    Generator,
    LogprobRecorder,
    Sampling,
    StopStrings,
    check_logprobs,
)
from pcd_engine.grammars import Grammar
from pcd_engine.options import SAMPLING_FIELDS, GenerateOptions
from pcd_engine.prompt import ChatPrompt, RawPrompt
from pcd_engine.results import Generation, GenerationChunk, TokenLogprob
from pcd_engine.schema import Limits
from pcd_engine.tools import as_tools

Message = Mapping[str, Any] | tuple[str, str]
Messages = Sequence[Message] | Conversation | RawPrompt


@dataclass(frozen=True)
class ChatCall:
    ids: list[int]  # the rendered conversation, ending with the assistant start
    max_tokens: int
    sampling: Sampling
    stops: StopStrings  # per call: it buffers streamed text
    grammar: Any = None  # the compiled grammar the answer must match (xgrammar), if any
    logprobs: int | None = None  # record each token's log-probability with this many alternatives

    def matchers(self, generator: Generator) -> list[Any] | None:
        return [generator.matcher(self.grammar)] if self.grammar is not None else None

    def recorder(self) -> LogprobRecorder | None:
        return LogprobRecorder.asked(1, self.logprobs)

    def generate(self, generator: Generator) -> Generation:
        (sequence,) = generator.run(
            [self.ids],
            max_new_tokens=self.max_tokens,
            sampling=self.sampling,
            stop_strings=self.stops.stops,
            matchers=self.matchers(generator),
            recorder=self.recorder(),
        )
        text = self.stops.cut(generator.tokenizer.decode(sequence.ids, skip_special_tokens=True))
        logprobs = None
        if sequence.logprobs is not None:
            logprobs = _up_to(generator.token_logprobs(sequence.logprobs), len(text))
        return Generation(
            text, sequence.finish_reason, len(self.ids), len(sequence.ids), logprobs, sequence.timings_ms
        )

    def stream(self, generator: Generator) -> Iterator[GenerationChunk]:
        """Text pieces as tokens are decoded; the last chunk has the finish reason and token counts.
        With `logprobs`, each chunk carries the tokens recorded since the previous chunk (up to a
        stop string)."""
        done: GeneratedSequence | None = None
        recorder = self.recorder()
        sent = 0

        def recorded(upto: int | None = None) -> tuple[TokenLogprob, ...] | None:
            nonlocal sent
            if recorder is None:
                return None
            steps = recorder.steps[0][sent:upto]
            steps = [s for s in steps if s.id not in generator.stop_ids]  # the final stop token
            sent += len(steps)
            return generator.token_logprobs(steps)

        pieces = generator.stream(
            self.ids,
            max_new_tokens=self.max_tokens,
            sampling=self.sampling,
            stop_strings=self.stops.stops,
            matchers=self.matchers(generator),
            recorder=recorder,
        )
        for piece in pieces:
            if isinstance(piece, GeneratedSequence):
                done = piece
            elif text := self.stops.feed(piece):
                yield GenerationChunk(text, logprobs=recorded())
        assert done is not None
        empty = None if recorder is None else ()
        tail = empty if self.stops.stopped else recorded(len(done.ids))
        if rest := self.stops.flush():
            yield GenerationChunk(rest, logprobs=tail)
            tail = empty
        yield GenerationChunk("", done.finish_reason, len(self.ids), len(done.ids), tail, done.timings_ms)


def _up_to(tokens: tuple[TokenLogprob, ...], length: int) -> tuple[TokenLogprob, ...]:
    """The leading tokens whose text starts within the first `length` characters (a stop string cuts
    the text inside the generated tokens)."""
    out, start = [], 0
    for token in tokens:
        if start >= length:
            break
        out.append(token)
        start += len(token.token)
    return tuple(out)


def chat_call(
    prompt: ChatPrompt,
    limits: Limits,
    messages: Messages,
    max_tokens: int,
    stop: Sequence[str] | str | None,
    sampling: Sampling,
    options: Mapping[str, Any],
    grammar: Any = None,
    logprobs: int | None = None,
    tools: Sequence[Mapping[str, Any]] = (),
) -> ChatCall:
    """The checked inputs of one chat call (`messages`, or a `RawPrompt` continued as written);
    `options` override fields of `sampling`; `grammar` is compiled; `tools` (OpenAI entries) are
    rendered by a template with a tool protocol."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InputError(f"max_tokens must be a positive int, got {max_tokens!r}")
    check_logprobs(logprobs)
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if not all(isinstance(s, str) for s in stops):
        raise InputError(f"stop must be a list of strings, got {stop!r}")
    try:
        chosen = Sampling(**{**vars(sampling), **options})
    except TypeError as error:
        raise InputError(f"unknown sampling option: {error}") from error
    if isinstance(messages, RawPrompt):
        ids = list(prompt.raw(prompt.raw_head, messages.text).ids)
        if not ids:
            raise InputError("the raw prompt is empty: there is nothing to continue")
    else:
        if isinstance(messages, str):  # a user message or a raw prompt? say which
            raise InputError(
                "messages must be a non-empty list of {'role': ..., 'content': ...} items, a "
                "Conversation, or a RawPrompt for text continued as written"
            )
        conversation = Conversation.of(messages)
        try:
            ids = prompt.render_conversation(conversation.system, conversation, tools)
        except InputError:
            raise
        except Exception as error:  # jinja2 TemplateError: roles the template rejects, bad order
            raise InputError(f"the chat template rejected the messages: {error}") from error
    if len(ids) > limits.max_prompt_tokens:
        raise InputError(
            f"the prompt is {len(ids)} tokens, over the limit of {limits.max_prompt_tokens} "
            "(Limits.max_prompt_tokens)"
        )
    return ChatCall(ids, max_tokens, chosen, StopStrings(stops), grammar, logprobs)


def stop_ids(model: Any, tokenizer: Any, prompt: ChatPrompt) -> list[int]:
    """The model's eos ids, the tokenizer's eos id and the template's end-of-turn token."""
    ids: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (configured, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(int(v) for v in value)
    ids.extend(prompt.end_of_turn_ids)
    return list(dict.fromkeys(ids))


class ChatMixin:
    """`generate` and `stream` of `PCDEngine`: plain chat on the engine's model and prompt."""

    prompt: ChatPrompt
    limits: Limits
    sampling: Sampling
    generator: Generator

    def generate(self, messages: Messages, **options: Unpack[GenerateOptions]) -> Generation:
        """Plain chat generation: a conversation (a `Conversation`, or messages as `Conversation.of`
        reads them: role/content dicts, earlier tool calls and results included, or pairs) in, the
        assistant's text out. The options are `GenerateOptions`.

        `stop` strings end the text (they are not included); `max_tokens` bounds the answer; decoding
        is greedy unless `sampling` or `temperature=`, `top_p=`, `top_k=`, `min_p=`,
        `repetition_penalty=`, `seed=` say otherwise. `json_object=True` constrains the answer to one
        JSON object (any keys: for a schema, use `classify`), `grammar=` to a regex, an EBNF grammar
        or a JSON schema (`Grammar`); either can still end at `max_tokens` before the text is
        complete. `messages`
        may be a `RawPrompt`: its text is continued as written, with no chat template.
        `logprobs=k` records each token's log-probability and its `k` (0 to 20) most probable
        alternatives in `Generation.logprobs` (see `TokenLogprob`). `tools` (as `engine.tools.call`
        takes them) are shown to a template with a tool protocol; no call is decided here.
        """
        return self._chat_call(messages, options).generate(self.generator)

    def stream(
        self, messages: Messages, **options: Unpack[GenerateOptions]
    ) -> collections.abc.Generator[GenerationChunk, None, None]:
        """`generate`, yielding text pieces as tokens are decoded; the last chunk carries the finish
        reason and the token counts (and with `logprobs=`, its chunks the tokens' log-probabilities).
        Closing the iterator early stops generation."""
        call = self._chat_call(messages, options)
        yield from call.stream(self.generator)  # a generator: bad inputs raise on the first next()

    def check_grammar(self, grammar: Grammar) -> None:
        """Compile `grammar` as `generate` would (xgrammar caches it): InputError if it cannot be."""
        self.generator.compile(grammar)

    def _chat_call(self, messages: Messages, options: GenerateOptions) -> ChatCall:
        if unknown := sorted(set(options) - GenerateOptions.__optional_keys__):  # a server's 400, too
            names = ", ".join(sorted(GenerateOptions.__optional_keys__))
            raise InputError(f"unknown sampling option {unknown[0]!r}; the options are {names}")
        json_object, grammar = options.get("json_object", False), options.get("grammar")
        if json_object and grammar is not None:
            raise InputError("pass either json_object=True or a grammar, not both")
        if grammar is not None and not isinstance(grammar, Grammar):
            raise InputError(f"grammar must be a Grammar, got {type(grammar).__name__}")
        wanted = Grammar.json_object() if json_object else grammar
        compiled = self.generator.compile(wanted) if wanted is not None else None  # before model work
        tools = options.get("tools", ())
        return chat_call(
            self.prompt,
            self.limits,
            messages,
            options.get("max_tokens", 512),
            options.get("stop"),
            options.get("sampling") or self.sampling,
            {k: v for k, v in options.items() if k in SAMPLING_FIELDS},
            compiled,
            options.get("logprobs"),
            [t.openai() for t in as_tools(tools)] if tools else (),
        )
