"""Generated text cut into the model's thinking and its answer, at the reasoning tags MiniCPM5 and
Qwen3 write (`<think>` ... `</think>`): what Ollama answers a request with `think: true` (`thinking`
beside `content`).

Thinking is what comes between an opening tag at the start of the text (or the start itself, when the
prompt already opened it) and the closing tag; the answer is what follows, leading blank lines
dropped. A text that does not open with the tag is all answer. `ThinkingStream` does the same piece
by piece, holding back the end of a piece that may be the start of a tag until the next one says.

    >>> split_thinking("<think>\\nTwo items.\\n</think>\\n\\nThey cost 4 euros.")
    ('Two items.\\n', 'They cost 4 euros.')
    >>> stream = ThinkingStream()
    >>> [stream.feed(piece) for piece in ("<thi", "nk>Hm.</th", "ink>Yes.")] + [stream.feed("", final=True)]
    [('', ''), ('Hm.', ''), ('', 'Yes.'), ('', '')]
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def split_thinking(text: str, opened: bool = False, final: bool = True) -> tuple[str, str]:
    """(thinking, answer) of `text`; `opened`: the prompt ended with the opening tag. Before the
    text is `final`, a tail that may still become a tag is left out of both."""
    body = text
    if not opened:
        start = text.lstrip()
        if not final and len(start) < len(OPEN) and OPEN.startswith(start):
            return "", ""  # not yet known whether the text opens with the tag
        if not start.startswith(OPEN):
            return "", text
        body = start[len(OPEN) :]
    end = body.find(CLOSE)
    if end >= 0:
        return body[:end].lstrip(), body[end + len(CLOSE) :].lstrip()
    if not final:
        body = body[: len(body) - _partial_tag(body)]
    return body.lstrip(), ""


class ThinkingStream:
    """`split_thinking` over pieces: each `feed` gives the (thinking, answer) text new since the last."""

    def __init__(self, opened: bool = False) -> None:
        self.opened, self.text, self.sent = opened, "", (0, 0)

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.text += piece
        thinking, answer = split_thinking(self.text, self.opened, final)
        new = thinking[self.sent[0] :], answer[self.sent[1] :]
        self.sent = (len(thinking), len(answer))
        return new


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` are a proper start of the closing tag."""
    for size in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if CLOSE.startswith(text[-size:]):
            return size
    return 0
