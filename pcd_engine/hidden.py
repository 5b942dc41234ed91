"""Hidden states read from a packed scoring pass: the features a head (`heads.py`) learns from.

Per prompt, with no extra forward call, the runner can keep:

- `fork`: the final hidden state (after the final norm) at each tree's fork, the last token its
  candidates share (its logits predict every value's first token), one row per tree;
- `text_last` / `text_middle`: the mean over the text's own tokens of the final hidden state and of
  the output of the decoder layer `middle_layer(model)`.

The text's tokens must be fed in the call (not read from a cached prefix): the scorer crops a cached
prefix that reaches into the text. A forward hook on the decoder and one on the middle layer see
each call's outputs; `HiddenCapture` says which positions of which row to read.

    >>> capture = HiddenCapture(text_start=40, text_end=52)  # doctest: +SKIP
    >>> scorer.score(plan, [ids], [stats], capture=[capture])  # doctest: +SKIP
    >>> capture.states().fork.shape  # (trees, hidden size)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

BLOCKS = ("fork", "text_last", "text_middle")  # the feature blocks a head may use besides the scores


@dataclass(frozen=True)
class HiddenStates:
    """One prompt's hidden states (float32, CPU)."""

    fork: torch.Tensor  # (trees, H)
    text_last: torch.Tensor  # (H,)
    text_middle: torch.Tensor  # (H,)

    def block(self, name: str, tree: int) -> torch.Tensor:
        return self.fork[tree] if name == "fork" else getattr(self, name)


@dataclass
class HiddenCapture:
    """Where one prompt's text lies (token indices in the whole prompt), and what the runner read."""

    text_start: int
    text_end: int
    forks: dict[int, torch.Tensor] = field(default_factory=dict)  # tree index -> (H,)
    text_last: torch.Tensor | None = None
    text_middle: torch.Tensor | None = None

    def states(self) -> HiddenStates:
        if self.text_last is None or self.text_middle is None:
            raise RuntimeError("the text was not fed in the captured call (a cached prefix covered it)")
        fork = torch.empty(0)
        if self.forks:  # row k is tree k's; a tree not fed (a gated decision not scored) is zeros
            fork = torch.zeros(max(self.forks) + 1, next(iter(self.forks.values())).shape[-1])
            for tree, state in self.forks.items():
                fork[tree] = state
        return HiddenStates(fork, self.text_last, self.text_middle)


def middle_layer(model: Any) -> int:
    """The decoder layer whose output is the text's middle feature: the middle one, rounded down
    (of 30 layers, layer 14; of 42, layer 20)."""
    return (len(decoder_layers(model)) - 1) // 2


def decoder_layers(model: Any) -> Sequence[torch.nn.Module]:
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}'s decoder has no `layers`; heads need one")
    return layers


@dataclass
class _Seen:
    last: torch.Tensor | None = None
    middle: torch.Tensor | None = None


@contextlib.contextmanager
def hooked(model: Any) -> Iterator[_Seen]:
    """While open, `seen.last` / `seen.middle` hold the (B, L, H) outputs of the decoder and of the
    middle layer in the latest forward call."""
    seen = _Seen()

    def keep(name: str):
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            if isinstance(output, tuple):
                output = output[0]
            elif not isinstance(output, torch.Tensor):
                output = output.last_hidden_state
            setattr(seen, name, output)

        return hook

    handles = [
        model.get_decoder().register_forward_hook(keep("last")),
        decoder_layers(model)[middle_layer(model)].register_forward_hook(keep("middle")),
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def read(
    seen: _Seen,
    row: int,
    capture: HiddenCapture,
    text: tuple[int, int] | None,
    forks: Sequence[tuple[int, int]],
) -> None:
    """Copy into `capture` what row `row` of the latest call holds: the mean over the fed positions
    `text` (start, end) and the fork state at each (tree index, position) of `forks`."""
    assert seen.last is not None and seen.middle is not None
    if text is not None:  # an empty text (allow_empty_text) pools to zeros
        start, end = text
        for name, states in (("text_last", seen.last), ("text_middle", seen.middle)):
            span = states[row, start:end].float()
            pooled = span.mean(dim=0) if end > start else torch.zeros(states.shape[-1])
            setattr(capture, name, pooled.cpu())
    for tree, position in forks:
        capture.forks[tree] = seen.last[row, position].float().cpu()
