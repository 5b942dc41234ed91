"""Autoregressive generation through Hugging Face `generate`: plain text and grammar-constrained JSON.

Constraints come from xgrammar: one `GrammarMatcher` per row masks the logits in a LogitsProcessor.
transformers runs custom processors before its sampling warpers (temperature, top-p, min-p), so a
sampled token is always one the grammar allows. Rows are left-padded into one batch; a prefix KV cache
(from the engine's PrefixCache) may be passed for a single row so that only the uncached tail of the
prompt is computed.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
)

from pcd_engine.errors import InputError
from pcd_engine.grammars import Grammar, compile_grammar
from pcd_engine.results import TokenLogprob

MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs
MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy decoding


@dataclass(frozen=True)
class Sampling:
    """Decoding parameters. `temperature=0` is greedy (the default); MiniCPM5 recommends
    temperature 1.0, top_p 0.95, min_p 0.0 for sampled chat."""

    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    top_k: int = 0  # sample from the k most probable tokens only; 0: all of them

    def __post_init__(self) -> None:
        checks = {
            "temperature": self.temperature >= 0,
            "top_p": 0 < self.top_p <= 1,
            "min_p": 0 <= self.min_p < 1,
            "repetition_penalty": self.repetition_penalty > 0,
            "top_k": isinstance(self.top_k, int) and self.top_k >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise InputError(f"sampling parameter {name}={getattr(self, name)!r} is out of range")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that dividing the logits by it overflows: its limit."""
        return self.temperature < MIN_TEMPERATURE

    def config(self) -> dict[str, Any]:
        if self.greedy:
            return {"do_sample": False, "repetition_penalty": self.repetition_penalty}
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p or None,
            "repetition_penalty": self.repetition_penalty,
        }


@dataclass(frozen=True)
class GeneratedSequence:
    ids: list[int]  # the generated tokens, stop token and padding removed
    finish_reason: str  # "stop" (stop token, stop string or grammar end) or "length" (token budget)
    steps: int  # decoding steps taken (forward calls)
    logprobs: list[StepLogprob] | None = None  # one per id, when a LogprobRecorder ran
    timings_ms: dict[str, float] = field(default_factory=dict, compare=False)  # "prefill", "decode": Clock


@dataclass(frozen=True)
class StepLogprob:
    """The chosen token's log-probability at one step and the `top` alternatives as (id, logprob)."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def check_logprobs(logprobs: int | None) -> None:
    """`logprobs=` is None (not recorded) or how many alternatives to keep per token, 0 to 20."""
    if logprobs is None:
        return
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise InputError(f"logprobs must be None or an int from 0 to {MAX_TOP_LOGPROBS}, got {logprobs!r}")


class LogprobRecorder(LogitsProcessor):
    """Records each row's chosen tokens' log-probabilities and the `top` alternatives per step.

    Placed after the grammar processor, it sees the logits transformers' own processors (repetition
    penalty) and the grammar mask have shaped, before the sampling warpers (temperature, top-p): the
    distribution greedy decoding takes its maximum from. A step's chosen token is known at the next
    call (the last input id) or, for the last step, from the output (`finish`). `steps[row]` grows
    as tokens are chosen, so a streaming reader can take the entries made so far."""

    def __init__(self, rows: int, top: int) -> None:
        self.top = top
        self.steps: list[list[StepLogprob]] = [[] for _ in range(rows)]
        self._last: torch.Tensor | None = None  # the previous step's log-softmax, one row per row

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._resolve(input_ids[:, -1])
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    @classmethod
    def asked(cls, rows: int, logprobs: int | None) -> LogprobRecorder | None:
        """A recorder for `rows` rows when `logprobs=` asks for one (not None), else None."""
        return None if logprobs is None else cls(rows, logprobs)

    def finish(self, last_ids: torch.Tensor) -> None:
        self._resolve(last_ids)

    def _resolve(self, chosen: torch.Tensor) -> None:
        if self._last is None:
            return
        logprobs = self._last.gather(1, chosen.view(-1, 1).to(self._last.device)).view(-1).tolist()
        if self.top:
            values, ids = self._last.topk(self.top, dim=-1)
            pairs = zip(ids.tolist(), values.tolist(), strict=True)  # a masked token is no alternative
            tops = [[(t, v) for t, v in zip(i, vs, strict=True) if v > -math.inf] for i, vs in pairs]
        else:
            tops = [[] for _ in logprobs]
        for row, (token, logprob, top) in enumerate(zip(chosen.tolist(), logprobs, tops, strict=True)):
            self.steps[row].append(StepLogprob(int(token), float(logprob), tuple(top)))
        self._last = None


class GrammarProcessor(LogitsProcessor):
    """Masks each row's logits to the tokens its xgrammar matcher allows (None: unconstrained)."""

    def __init__(self, matchers: Sequence[Any | None], vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.matchers = list(matchers)
        self.bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
        self.calls = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.calls:
            for row, matcher in enumerate(self.matchers):
                if matcher is not None and not matcher.is_terminated():
                    token = int(input_ids[row, -1])
                    if not matcher.accept_token(token):
                        raise RuntimeError(f"row {row}: the grammar rejected token {token}")
        self.calls += 1
        self.bitmask.fill_(-1)
        for row, matcher in enumerate(self.matchers):
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(self.bitmask, row)
        self.xgr.apply_token_bitmask_inplace(scores, self.bitmask.to(scores.device))
        return scores


class _Cancelled(StoppingCriteria):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.Tensor:
        return torch.full(
            (input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device
        )


class Clock(StoppingCriteria):
    """Times one `generate` call in two phases: "prefill" runs until the first token is chosen (the
    prompt's forward call; stopping criteria are first asked right after it), "decode" is the rest.
    Rows of one call share its times."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.first: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.Tensor:
        if self.first is None:
            if input_ids.is_cuda:  # the prompt's kernels may still run; generate syncs right after anyway
                torch.cuda.synchronize(input_ids.device)
            self.first = time.perf_counter()
        return torch.zeros((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)

    def timings_ms(self) -> dict[str, float]:
        ended = time.perf_counter()
        first = ended if self.first is None else self.first
        return {"prefill": (first - self.started) * 1e3, "decode": (ended - first) * 1e3}


class Generator:
    """Runs `model.generate` for rows of prompt ids, with optional grammar matchers per row."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop_ids: Sequence[int],
        cache_kw: str,
        grammar_cache_bytes: int = 256 * 2**20,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stop_ids = list(dict.fromkeys(int(i) for i in stop_ids))
        if not self.stop_ids:
            raise ValueError("generation needs at least one stop token id (eos)")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.stop_ids[0]
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._cache_kw = cache_kw
        self.grammar_cache_bytes = grammar_cache_bytes  # xgrammar's compiled grammars, by schema
        self._compiler: Any = None
        self._lock = threading.Lock()

    def compile_json(self, schema_json: str) -> Any:
        """An xgrammar grammar for compact JSON (`, ` and `: ` separators) valid under the schema."""
        with self._lock:
            return self._grammar_compiler().compile_json_schema(
                schema_json, any_whitespace=False, separators=(", ", ": "), strict_mode=True
            )

    def compile(self, grammar: Grammar) -> Any:
        """xgrammar's compiled form of a `Grammar` (InputError when it does not compile)."""
        with self._lock:
            return compile_grammar(self._grammar_compiler(), grammar)

    def _grammar_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
            )
            self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=self.grammar_cache_bytes)
        return self._compiler

    @property
    def grammar_cache_size(self) -> int:
        """Bytes held by xgrammar's cache of compiled grammars (0 before the first grammar)."""
        return int(self._compiler.get_cache_size_bytes()) if self._compiler is not None else 0

    def clear_grammars(self) -> None:
        """Empty xgrammar's cache of compiled grammars."""
        with self._lock:
            if self._compiler is not None:
                self._compiler.clear_cache()

    @staticmethod
    def matcher(grammar: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(grammar)

    @torch.inference_mode()
    def run(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        matchers: Sequence[Any] | None = None,
        stop_strings: Sequence[str] = (),
        streamer: Any = None,
        cache: Any = None,
        cancel: threading.Event | None = None,
        recorder: LogprobRecorder | None = None,
    ) -> list[GeneratedSequence]:
        """Generate for every row; returns one GeneratedSequence per row, in order (with each token's
        log-probability when a `recorder` is given)."""
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt))
            mask[row, width - len(prompt) :] = 1
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            stop_strings=list(stop_strings) or None,
            **sampling.config(),
        )
        kwargs: dict[str, Any] = {}
        processors: list[LogitsProcessor] = []
        if matchers is not None:
            processors.append(GrammarProcessor(matchers, self.vocab_size))
        if recorder is not None:
            processors.append(recorder)  # after the grammar mask
        if processors:
            kwargs["logits_processor"] = LogitsProcessorList(processors)
        if stop_strings:
            kwargs["tokenizer"] = self.tokenizer  # stop strings are matched on token texts
        clock = Clock()
        criteria: list[StoppingCriteria] = [clock]
        if cancel is not None:
            criteria.append(_Cancelled(cancel))
        kwargs["stopping_criteria"] = StoppingCriteriaList(criteria)
        if cache is not None:
            kwargs[self._cache_kw] = cache
        with torch.random.fork_rng(devices=[]) if sampling.seed is not None else nullcontext():
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=config,
                streamer=streamer,
                **kwargs,
            )
        timings = clock.timings_ms()
        if recorder is not None and out.shape[1] > width:
            recorder.finish(out[:, -1])
        new = out[:, width:].tolist()
        sequences = [
            dataclasses.replace(self._sequence(row, max_new_tokens, stop_strings), timings_ms=timings)
            for row in new
        ]
        if recorder is None:
            return sequences
        return [
            dataclasses.replace(c, logprobs=steps[: len(c.ids)])
            for c, steps in zip(sequences, recorder.steps, strict=True)
        ]

    def token_logprobs(self, steps: Sequence[StepLogprob]) -> tuple[TokenLogprob, ...]:
        """The recorded steps with their tokens as text (each decoded on its own)."""
        decode = self.tokenizer.decode

        def text(token: int) -> str:
            return decode([token], skip_special_tokens=False)

        return tuple(
            TokenLogprob(text(s.id), s.logprob, tuple((text(i), p) for i, p in s.top)) for s in steps
        )

    def _sequence(
        self, row: list[int], max_new_tokens: int, stop_strings: Sequence[str]
    ) -> GeneratedSequence:
        steps = len(row)
        while row and row[-1] == self.pad_id and self.pad_id not in self.stop_ids:
            row = row[:-1]
        stops = [i for i, token in enumerate(row) if token in self.stop_ids]
        if stops:
            return GeneratedSequence(row[: stops[0]], "stop", stops[0] + 1)
        if len(row) < max_new_tokens:  # ended early without a stop token: a stop string
            return GeneratedSequence(row, "stop", steps)
        text = self.tokenizer.decode(row, skip_special_tokens=True) if stop_strings else ""
        if any(s in text for s in stop_strings):  # a stop string in the very last token
            return GeneratedSequence(row, "stop", steps)
        return GeneratedSequence(row, "length", steps)

    def stream(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        stop_strings: Sequence[str],
        matchers: Sequence[Any] | None = None,
        recorder: LogprobRecorder | None = None,
    ) -> Iterator[str | GeneratedSequence]:
        """Text pieces as they are decoded, then the GeneratedSequence. Closing the iterator stops generation.
        A `recorder`'s `steps[0]` grows while the pieces come."""
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        cancel = threading.Event()
        outcome: dict[str, Any] = {}

        def work() -> None:
            try:
                outcome["done"] = self.run(
                    [prompt],
                    max_new_tokens=max_new_tokens,
                    sampling=sampling,
                    stop_strings=stop_strings,
                    matchers=matchers,
                    streamer=streamer,
                    cancel=cancel,
                    recorder=recorder,
                )[0]
            except BaseException as error:  # re-raised in the caller's thread
                outcome["error"] = error
                streamer.end()

        thread = threading.Thread(target=work, name="pcd-generate", daemon=True)
        thread.start()
        try:
            yield from streamer
        finally:
            cancel.set()
            thread.join()
        if "error" in outcome:
            raise outcome["error"]
        yield outcome["done"]


class StopStrings:
    """Cuts text at the first stop string; when streaming, holds back what may start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.buffer = ""
        self.stopped = False

    def cut(self, text: str) -> str:
        hits = [text.find(s) for s in self.stops if s in text]
        return text[: min(hits)] if hits else text

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.buffer += piece
        cut = self.cut(self.buffer)
        if len(cut) < len(self.buffer):
            self.stopped, self.buffer = True, ""
            return cut
        hold = max(
            (n for s in self.stops for n in range(1, len(s)) if self.buffer.endswith(s[:n])), default=0
        )
        out, self.buffer = self.buffer[: len(self.buffer) - hold], self.buffer[len(self.buffer) - hold :]
        return out

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out
