"""Structured-output and agent libraries that speak the OpenAI API, unchanged, against a real `pcd serve`
on SmolLM2: instructor (`Mode.TOOLS`, `Mode.JSON_SCHEMA`) and smolagents' `ToolCallingAgent` (an
agent framework other than LangChain and LlamaIndex: OpenAI tool calls with `tool_choice: "required"`
and its `final_answer` tool)."""

from __future__ import annotations

import json
from typing import Literal

import instructor
import openai
import pytest
from pydantic import BaseModel, Field
from smolagents import OpenAIServerModel, ToolCallingAgent, tool

from tests.helpers import KEY

pytestmark = pytest.mark.slow
TEXT = "I was charged twice for my subscription, please refund the second payment."


class Ticket(BaseModel):
    """A customer-support message to route."""

    topic: Literal["billing", "delivery", "account", "technical", "other"]
    refund_requested: bool = Field(description="Does the customer ask for money back?")


@tool
def lookup_order(order_id: str) -> str:
    """Look up where an order is.

    Args:
        order_id: The order's id, as the customer wrote it.
    """
    return f"Order {order_id} was shipped on Monday and arrives on Friday."


def test_instructor_tools_mode_gets_the_forced_calls_object(url, engine):
    client = instructor.from_openai(
        openai.OpenAI(base_url=url, api_key=KEY, max_retries=0), mode=instructor.Mode.TOOLS
    )
    ticket, raw = client.chat.completions.create_with_completion(
        model="smollm2", response_model=Ticket, messages=[{"role": "user", "content": TEXT}], max_retries=0
    )
    (call,) = raw.choices[0].message.tool_calls
    assert call.function.name == "Ticket"  # instructor answers an instance of its own Ticket subclass
    assert ticket.model_dump() == Ticket.model_validate_json(call.function.arguments).model_dump()
    pcd = raw.choices[0].model_extra["pcd"]
    assert pcd["call_id"] == call.id and set(pcd["arguments"]) == {"topic", "refund_requested"}
    assert pcd["arguments"]["topic"]["value"] == ticket.topic


def test_instructor_json_schema_mode_equals_the_in_process_engine(url, engine):
    client = instructor.from_openai(
        openai.OpenAI(base_url=url, api_key=KEY, max_retries=0), mode=instructor.Mode.JSON_SCHEMA
    )
    ticket, raw = client.chat.completions.create_with_completion(
        model="smollm2", response_model=Ticket, messages=[{"role": "user", "content": TEXT}], max_retries=0
    )
    assert ticket.model_dump() == Ticket.model_validate_json(raw.choices[0].message.content).model_dump()
    reference = engine.classify(TEXT, Ticket)
    assert ticket.model_dump() == reference.value.model_dump()
    fields = raw.choices[0].model_extra["pcd"]["fields"]
    assert fields["topic"]["probabilities"] == pytest.approx(
        reference.fields["topic"].probabilities, abs=1e-4
    )


def test_a_smolagents_tool_calling_agent_runs_unchanged(url):
    model = OpenAIServerModel(model_id="smollm2", api_base=url, api_key=KEY, max_tokens=48)
    agent = ToolCallingAgent(tools=[lookup_order], model=model, max_steps=3, verbosity_level=0)
    answer = agent.run("Where is my order A123?")
    assert answer is not None
    steps = [s for s in agent.memory.steps if getattr(s, "tool_calls", None)]
    assert steps, "the agent made no tool call"
    called = [c.name for s in steps for c in s.tool_calls]
    assert set(called) <= {"lookup_order", "final_answer"}
    for step in steps:  # every call the server answered parsed as a call of a known tool
        assert step.error is None, step.error
        for c in step.tool_calls:
            json.dumps(c.arguments)
