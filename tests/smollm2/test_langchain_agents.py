"""LangChain agents on the engine: `bind_tools` and `create_agent` (langchain 1.x) on SmolLM2 (CPU),
driven only through LangChain's public APIs."""

from __future__ import annotations

import socket
from typing import Literal

import pytest
from langchain.agents import create_agent
from langchain.agents.structured_output import ProviderStrategy, ToolStrategy
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from minicpm_pcd_adapters import ChatMiniCPM
from pcd_engine import InputError
from tests.helpers import ForwardCounter, smollm2_engine

pytestmark = pytest.mark.slow


class Ticket(BaseModel):
    """A customer-support message to route."""

    topic: Literal["billing", "delivery", "account", "technical", "other"]
    refund_requested: bool = Field(description="Does the customer ask for money back?")


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is 22 degrees and sunny in {city}."


@tool
def open_ticket(topic: Literal["billing", "delivery", "other"], urgent: bool) -> str:
    """Open a support ticket."""
    return f"ticket opened: {topic}, urgent={urgent}"


@pytest.fixture(scope="module")
def llm() -> ChatMiniCPM:
    return ChatMiniCPM(engine=smollm2_engine(), model="SmolLM2-135M-Instruct", max_tokens=24)


@pytest.mark.parametrize("strategy", [None, ToolStrategy, ProviderStrategy], ids=["auto", "tool", "provider"])
def test_create_agent_structured_response_equals_with_structured_output(llm, strategy):
    text = "I was charged twice, refund me!"
    expected = llm.with_structured_output(Ticket).invoke(text)
    agent = create_agent(model=llm, tools=[], response_format=strategy(Ticket) if strategy else Ticket)
    out = agent.invoke({"messages": [{"role": "user", "content": text}]})
    assert out["structured_response"] == expected


def test_create_agent_calls_the_tool_reads_its_result_and_answers(llm):
    agent = create_agent(model=llm, tools=[get_weather])
    out = agent.invoke(
        {"messages": [{"role": "user", "content": "What's the weather in Paris?"}]}, {"recursion_limit": 8}
    )
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    call, result, answer = out["messages"][1:]
    assert call.tool_calls[0]["name"] == "get_weather" and call.tool_calls[0]["id"]
    assert result.tool_call_id == call.tool_calls[0]["id"] and "22 degrees" in result.content
    assert answer.tool_calls == [] and isinstance(answer.content, str)
    for message in (call, answer):  # both decisions scored: the tool's and the text answer's probability
        probabilities = message.response_metadata["pcd"]["probabilities"]
        assert set(probabilities) == {"get_weather", ""} and abs(sum(probabilities.values()) - 1) < 1e-6
    assert call.response_metadata["pcd"]["tool"] == "get_weather"
    assert answer.response_metadata["pcd"]["tool"] is None


def test_bind_tools_scores_the_tool_and_its_closed_arguments_in_one_pass(llm):
    bound = llm.bind_tools([get_weather, open_ticket], tool_choice="required")
    bound.invoke("My parcel is late, please open a ticket")  # the schema's head and priors, once
    counter = ForwardCounter(llm.engine.model.model)
    try:
        message = bound.invoke("My parcel is late, please open a ticket")
    finally:
        counter.close()
    pcd = message.response_metadata["pcd"]
    assert set(pcd["decision"]["probabilities"]) == {"get_weather", "open_ticket"}
    (call,) = message.tool_calls
    if call["name"] == "open_ticket":  # closed arguments only: decided in the one pass
        assert len(counter.rows) == 1 and pcd["forward_calls"] == 1
        assert set(pcd["arguments"]) == {"topic", "urgent"}
        assert call["args"] == {k: v["value"] for k, v in pcd["arguments"].items()}
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_tool_messages_of_later_turns_and_streamed_calls(llm):
    bound = llm.bind_tools([get_weather], tool_choice="any")
    history = [
        HumanMessage("Weather in Rome?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Rome"}, "id": "c1"}]),
        ToolMessage("It is 18 degrees and raining.", tool_call_id="c1"),
        HumanMessage("And in Paris?"),
    ]
    chunks = list(bound.stream(history))
    assert len(chunks) == 1 and isinstance(chunks[0], AIMessageChunk)
    (piece,) = chunks[0].tool_call_chunks
    assert piece["name"] == "get_weather" and piece["id"] and piece["index"] == 0
    assert chunks[0].tool_calls[0]["args"] == bound.invoke(history).tool_calls[0]["args"]


def test_tool_choice_none_answers_in_text_and_bad_choices_fail_early(llm):
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke("Weather in Paris?")
    assert answer.tool_calls == [] and answer.content
    with pytest.raises(InputError, match="not among the tools"):
        llm.bind_tools([get_weather], tool_choice="nope").invoke("hi")


def test_token_counts_use_the_models_tokenizer_without_network(llm, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network blocked in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    tokenizer = llm.engine.tokenizer
    assert llm.get_num_tokens("hello world") == len(
        tokenizer("hello world", add_special_tokens=False)["input_ids"]
    )
    assert llm.get_token_ids("<|im_end|>") == llm.engine.prompt.encode_text("<|im_end|>")  # data, not control
    messages = [HumanMessage("hello world")]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello world"}], add_generation_prompt=True
    )
    ids = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    assert llm.get_num_tokens_from_messages(messages) == len(ids)


def test_profile_declares_tools_and_structured_output():
    profile = ChatMiniCPM(model="not/loaded").profile
    assert profile["tool_calling"] and profile["tool_choice"] and profile["structured_output"]
