"""Generation (generate.py) on a tiny Llama: greedy equal to transformers' `generate`, streams, stop
strings, limits, seeded sampling, token log-probabilities. Chat calls' checks: test_chat.py."""

from __future__ import annotations

import time

import pytest
import torch

from pcd_engine import Generation, Sampling
from pcd_engine.generate import StopStrings
from tests.helpers import ForwardCounter

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is my parcel?"}]


def test_generate_equals_hf_greedy_generate(engine, tiny_model, tiny_tokenizer):
    result = engine.generate(MESSAGES, max_tokens=12)
    ids = engine.prompt.render_messages([(m["role"], m["content"]) for m in MESSAGES])
    out = tiny_model.generate(
        torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=engine.generator.stop_ids
    )
    new = out[0, len(ids) :].tolist()
    new = new[: new.index(2)] if 2 in new else new  # 2 = <|im_end|>
    assert result.text == tiny_tokenizer.decode(new, skip_special_tokens=True)
    assert result.prompt_tokens == len(ids) and result.completion_tokens == len(new)
    assert result.finish_reason in ("stop", "length")


def test_max_tokens_ends_with_length(engine):
    result = engine.generate(MESSAGES, max_tokens=3)
    assert result.completion_tokens <= 3
    if result.completion_tokens == 3:
        assert result.finish_reason == "length"


def test_stream_pieces_add_up_to_generate(engine):
    whole = engine.generate(MESSAGES, max_tokens=16)
    chunks = list(engine.stream(MESSAGES, max_tokens=16))
    assert "".join(c.text for c in chunks) == whole.text
    assert len(chunks) > 2  # streamed piece by piece, not as one block
    last = chunks[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == (
        whole.finish_reason,
        whole.prompt_tokens,
        whole.completion_tokens,
    )


class _Slow:
    """Sleeps before the model's forward calls: `prefill` seconds for the prompt's (several tokens),
    `step` seconds for each decoding step (one token)."""

    def __init__(self, model, prefill: float, step: float) -> None:
        self.prefill, self.step = prefill, step
        self.handle = model.register_forward_pre_hook(self._wait, with_kwargs=True)

    def _wait(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        time.sleep(self.prefill if ids.shape[1] > 1 else self.step)


def test_timings_split_the_prompt_from_the_decoded_tokens(engine, tiny_model):
    slow = _Slow(tiny_model, prefill=0.25, step=0.0)
    try:
        whole = engine.generate(MESSAGES, max_tokens=8, stop=[])
        last = list(engine.stream(MESSAGES, max_tokens=8))[-1]
    finally:
        slow.handle.remove()
    for timings in (whole.timings_ms, last.timings_ms):
        assert timings is not None and set(timings) == {"prefill", "decode"}
        assert timings["prefill"] >= 250 > timings["decode"]
    slow = _Slow(tiny_model, prefill=0.0, step=0.05)
    try:
        whole = engine.generate(MESSAGES, max_tokens=8, stop=[])
    finally:
        slow.handle.remove()
    decoded_steps = whole.completion_tokens - 1  # the first token comes with the prompt's call
    assert decoded_steps >= 2
    assert whole.timings_ms["decode"] >= 50 * decoded_steps > whole.timings_ms["prefill"]


def test_stop_strings_cut_generate_and_stream(engine):
    whole = engine.generate(MESSAGES, max_tokens=16).text
    assert len(whole) > 4
    stop = whole[2:4]
    cut = engine.generate(MESSAGES, max_tokens=16, stop=[stop])
    assert cut.text == whole[: whole.index(stop)] and cut.finish_reason == "stop"
    assert "".join(c.text for c in engine.stream(MESSAGES, max_tokens=16, stop=[stop])) == cut.text


def test_stop_string_buffer_holds_back_partial_matches():
    stops = StopStrings(["END"])
    assert stops.feed("abc E") == "abc "
    assert stops.feed("N") == ""
    assert stops.feed("Dx") == "" and stops.stopped
    other = StopStrings(["END"])
    assert other.feed("E") == "" and other.feed("gg") == "Egg" and other.flush() == ""


def test_closing_a_stream_early_stops_generation(engine):
    counter = ForwardCounter(engine.model.get_decoder())
    try:
        whole = engine.generate(MESSAGES, max_tokens=64)
        calls_of_the_whole = len(counter.rows)
        counter.rows.clear()
        stream = engine.stream(MESSAGES, max_tokens=64)
        next(stream)
        stream.close()  # joins the worker thread; must not hang
        calls_until_closed = len(counter.rows)
        time.sleep(0.2)
        calls_later = len(counter.rows)
    finally:
        counter.close()
    assert whole.finish_reason == "length" and calls_of_the_whole >= 64  # it would have run 64 steps
    assert calls_until_closed < 16  # the first piece comes after a few tokens; closing ends the loop
    assert calls_later == calls_until_closed  # nothing runs after close


def test_sampling_with_a_seed_is_reproducible(engine):
    first = engine.generate(MESSAGES, max_tokens=8, temperature=1.0, top_p=0.95, seed=7)
    second = engine.generate(MESSAGES, max_tokens=8, sampling=Sampling(temperature=1.0, top_p=0.95, seed=7))
    assert first == second and isinstance(first, Generation)


def _reference_logprobs(model, prompt_ids, new_ids):
    """Each new token's log-probability and the log-softmax rows, from one plain forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt_ids, *new_ids]])).logits[0].float()
    rows = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return rows, [float(rows[i, t]) for i, t in enumerate(new_ids)]


def test_logprobs_are_the_models_own_for_each_greedy_token(engine, tiny_model, tiny_tokenizer):
    result = engine.generate(MESSAGES, max_tokens=10, logprobs=3)
    ids = engine.prompt.render_messages([(m["role"], m["content"]) for m in MESSAGES])
    assert result.logprobs is not None and len(result.logprobs) == result.completion_tokens
    assert "".join(t.token for t in result.logprobs) == result.text
    out = tiny_model.generate(
        torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=engine.generator.stop_ids
    )
    new = out[0, len(ids) :].tolist()[: result.completion_tokens]
    assert [t.token for t in result.logprobs] == [tiny_tokenizer.decode([i]) for i in new]
    rows, expected = _reference_logprobs(tiny_model, ids, new)
    assert [t.logprob for t in result.logprobs] == pytest.approx(expected, abs=1e-4)
    for step, token in enumerate(result.logprobs):
        assert len(token.top) == 3
        assert token.top[0] == (token.token, pytest.approx(token.logprob, abs=1e-6))  # greedy: the best
        best = rows[step].topk(3)
        assert [p for _, p in token.top] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert [t for t, _ in token.top] == [tiny_tokenizer.decode([i]) for i in best.indices.tolist()]


def test_logprobs_are_off_by_default_and_follow_streams_and_stop_strings(engine):
    plain = engine.generate(MESSAGES, max_tokens=12)
    assert plain.logprobs is None and all(c.logprobs is None for c in engine.stream(MESSAGES, max_tokens=12))
    whole = engine.generate(MESSAGES, max_tokens=12, logprobs=0)
    assert whole.text == plain.text and all(t.top == () for t in whole.logprobs)
    chunks = list(engine.stream(MESSAGES, max_tokens=12, logprobs=0))
    assert tuple(t for c in chunks for t in c.logprobs) == whole.logprobs
    stop = plain.text[3:5]
    cut = engine.generate(MESSAGES, max_tokens=12, stop=[stop], logprobs=0)
    assert "".join(t.token for t in cut.logprobs).startswith(cut.text)
    assert len(cut.logprobs) < len(whole.logprobs)
