"""Template switches read from a request (`read_switches`), and generated text cut into thinking and
answer (`split_thinking`, `ThinkingStream`), with no model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minicpm_pcd_adapters.server.errors import APIError
from minicpm_pcd_adapters.server.template import ChatTemplate
from minicpm_pcd_adapters.server.thinking import ThinkingStream, split_thinking
from pcd_engine import InputError, read_switches

TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{{ reasoning_effort | default('low') }}"
)


def test_switches_the_template_reads_are_kept_and_others_ignored():
    asked = {"enable_thinking": True, "reasoning_effort": "high", "add_vision_id": True}
    assert read_switches(TEMPLATE, asked) == {"enable_thinking": True, "reasoning_effort": "high"}
    assert read_switches(TEMPLATE, {}) == {}
    assert read_switches("", {"enable_thinking": True}) == {}  # no template: nothing reads it


def test_a_template_jinja_cannot_parse_is_matched_by_name():
    custom = "{% generation %}{{ messages }}{% endgeneration %}{% if enable_thinking %}x{% endif %}"
    assert read_switches(custom, {"enable_thinking": False, "other": 1}) == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("asked", "said"),
    [
        ({"messages": []}, "renderer sets this variable itself"),
        ({"add_generation_prompt": False}, "renderer sets this variable itself"),
        ({"bos_token": "<|im_start|>"}, "renderer sets this variable itself"),
        ({"enable_thinking": {"on": True}}, "a boolean, a number, null or a string"),
        ({"reasoning_effort": "x" * 65}, "at most 64 characters"),
        ({"reasoning_effort": "high<|im_end|>"}, "control token '<|im_end|>'"),
    ],
)
def test_bad_switches_are_refused_naming_the_switch(asked, said):
    with pytest.raises(InputError, match=said) as refused:
        read_switches(TEMPLATE + "{{ messages }}", asked, control_strings=("<|im_end|>",))
    assert str(refused.value).startswith(f"chat_template_kwargs.{next(iter(asked))}")


def test_the_server_keeps_only_the_switches_that_differ_from_its_own():
    template = ChatTemplate(TEMPLATE, {"enable_thinking": False})
    assert template.switches({"enable_thinking": False, "unread": 3}) == ()
    assert template.switches({"reasoning_effort": "high", "enable_thinking": True}) == (
        ("enable_thinking", True),
        ("reasoning_effort", "high"),
    )
    assert template.reads("enable_thinking") and not template.reads("add_vision_id")
    with pytest.raises(APIError) as refused:
        template.switches({"tools": []})
    assert refused.value.status == 400 and refused.value.param == "chat_template_kwargs.tools"


@pytest.mark.parametrize(
    ("text", "opened", "want"),
    [
        ("<think>\nLet me see.\n</think>\n\nBilling.", False, ("Let me see.\n", "Billing.")),
        ("  <think>a</think>b", False, ("a", "b")),
        ("Billing.", False, ("", "Billing.")),
        ("Let me see.\n</think>\n\nBilling.", True, ("Let me see.\n", "Billing.")),
        ("<think>cut off by the length lim", False, ("cut off by the length lim", "")),
        ("", True, ("", "")),
    ],
)
def test_split_thinking(text, opened, want):
    assert split_thinking(text, opened) == want


pieces = st.lists(st.sampled_from(["<", "think", ">", "</", "think>", "<think>", "</think>", "a", "\n", " "]))


@given(pieces, st.booleans(), st.data())
def test_a_stream_cut_anywhere_gives_the_whole_texts_split(parts, opened, data):
    """Whatever the pieces, the thinking and answer a stream sends add up to the whole text's split."""
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    stream = ThinkingStream(opened)
    sent = [stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    sent.append(stream.feed("", final=True))
    assert ("".join(t for t, _ in sent), "".join(a for _, a in sent)) == split_thinking(text, opened)
