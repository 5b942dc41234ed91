"""The conversation value and the converters of every door, with no model: each door's messages give
the same Conversation, bad turns are InputErrors that name them, tool results tie to their calls."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from llama_index.core.base.llms.types import ChatMessage as LlamaMessage
from llama_index.core.base.llms.types import ToolCallBlock

from minicpm_pcd_adapters.langchain.messages import conversation_of as from_langchain
from minicpm_pcd_adapters.llama_index.messages import conversation_of as from_llama_index
from minicpm_pcd_adapters.server.calls import RequestLimits
from minicpm_pcd_adapters.server.calls import conversation_of as from_server
from minicpm_pcd_adapters.server.errors import APIError
from minicpm_pcd_adapters.server.protocol import ChatCompletionRequest
from pcd_engine import Call, Conversation, InputError, Turn, new_call_id

OPENAI = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Where is "}, {"type": "text", "text": "A1?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"id": "A1"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "shipped"},
    {"role": "user", "content": "Thanks!"},
]
EXPECTED = Conversation(
    (
        Turn("user", "Where is A1?"),
        Turn("assistant", "", (Call("lookup", {"id": "A1"}, "c1"),)),
        Turn("tool", "shipped", call_id="c1", name="lookup"),
        Turn("user", "Thanks!"),
    ),
    system="Be brief.",
)


def test_every_door_reads_the_same_conversation():
    assert Conversation.of(OPENAI) == EXPECTED
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": OPENAI})
    assert from_server(request.messages, RequestLimits()) == EXPECTED
    langchain = [
        SystemMessage("Be brief."),
        HumanMessage([{"type": "text", "text": "Where is "}, "A1?"]),
        AIMessage("", tool_calls=[{"name": "lookup", "args": {"id": "A1"}, "id": "c1"}]),
        ToolMessage("shipped", tool_call_id="c1"),
        ChatMessage(role="user", content="Thanks!"),
    ]
    assert from_langchain(langchain) == EXPECTED
    llama = [
        LlamaMessage(role="developer", content="Be brief."),
        LlamaMessage(role="user", content="Where is A1?"),
        LlamaMessage(
            role="assistant",
            blocks=[ToolCallBlock(tool_call_id="c1", tool_name="lookup", tool_kwargs={"id": "A1"})],
        ),
        LlamaMessage(role="tool", content="shipped", additional_kwargs={"tool_call_id": "c1"}),
        LlamaMessage(role="user", content="Thanks!"),
    ]
    assert from_llama_index(llama) == EXPECTED
    openai_style = [
        *llama[:2],
        LlamaMessage(role="assistant", content="", additional_kwargs={"tool_calls": OPENAI[2]["tool_calls"]}),
        *llama[3:],
    ]
    assert from_llama_index(openai_style) == EXPECTED


def test_a_string_is_one_user_turn_and_renders_as_one():
    conversation = Conversation.of("charged twice")
    assert conversation.user_text == "charged twice" and conversation.text == "charged twice"
    assert conversation.system is None and conversation == Conversation((Turn("user", "charged twice"),))
    assert hash(conversation) == hash(Conversation.of([("user", "charged twice")]))


def test_results_tie_to_their_calls_by_id_or_in_order():
    untied = Conversation.of(
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"name": "weather", "arguments": {"city": "Paris"}},
                    {"name": "time", "arguments": {}},
                ],
            },
            {"role": "tool", "content": "22 C"},
            {"role": "tool", "content": "noon"},
        ]
    )
    first, second = untied.turns[1].calls
    assert first.id.startswith("call_") and first.id != second.id  # minted: the call had none
    assert [(t.call_id, t.name) for t in untied.turns[2:]] == [(first.id, "weather"), (second.id, "time")]
    assert len({new_call_id() for _ in range(100)}) == 100


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ({"role": "user", "content": "hi"}, "non-empty list"),
        ([{"role": "user"}], "message #0: content must be a str"),
        ([{"role": "robot", "content": "hi"}], "message #0: role 'robot'"),
        ([{"role": "system", "content": "only system"}], "at least one"),
        ([{"role": "assistant", "content": "only me"}], "not only assistant turns"),
        ([("user", "hi"), {"role": "tool", "content": "x"}], "turn #1: a tool result answers"),
        ([("user", "hi"), {"role": "tool", "tool_call_id": "nope", "content": "x"}], "'nope'"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content"),
        (
            [("user", "hi"), {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{"}]}],
            "not JSON",
        ),
        ([("user", "hi"), {"role": "assistant", "tool_calls": [{"arguments": {}}]}], "needs a name"),
        (
            [("user", "hi"), {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "[1]"}]}],
            "an object",
        ),
        ([3], "message #0 must be a dict"),
    ],
)
def test_bad_messages_are_input_errors_naming_the_message(messages, match):
    with pytest.raises(InputError, match=match):
        Conversation.of(messages)


def test_the_server_answers_bad_turns_with_a_400_naming_them():
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "tool", "content": "x", "tool_call_id": "c9"},
            ],
        }
    )
    with pytest.raises(APIError, match="'c9'") as raised:
        from_server(request.messages, RequestLimits())
    assert raised.value.status == 400


def test_without_a_tool_protocol_calls_are_left_out_and_results_are_tool_turns():
    assert EXPECTED.plain_turns() == [("user", "Where is A1?"), ("tool", "shipped"), ("user", "Thanks!")]
    assert EXPECTED.plain_turns("user") == [
        ("user", "Where is A1?"),
        ("user", "The tool lookup returned:\nshipped"),
        ("user", "Thanks!"),
    ]
    spoke = Conversation.of([*OPENAI[:2], {**OPENAI[2], "content": "Let me look."}, *OPENAI[3:]])
    assert spoke.plain_turns()[1] == ("assistant", "Let me look.")  # its words stay, the call does not
    assert EXPECTED.text == "User: Where is A1?\n\nTool: shipped\n\nUser: Thanks!"
