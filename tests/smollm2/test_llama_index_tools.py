"""LlamaIndex function calling on the engine, through LlamaIndex's public API: FunctionCallingProgram,
predict_and_call, a FunctionAgent step with a tool, LLMTextCompletionProgram; SmolLM2 (CPU)."""

from __future__ import annotations

from typing import Literal

import pytest
from llama_index.core import Settings
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
from llama_index.core.program import FunctionCallingProgram, LLMTextCompletionProgram
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from minicpm_pcd_adapters import MiniCPMLLM, MiniCPMPCDProgram
from minicpm_pcd_adapters.minicpm import MINICPM5_2B
from tests.helpers import smollm2_engine

TEXT = "I was charged twice for my order, please refund me."


class Ticket(BaseModel):
    """A customer-support message to route."""

    topic: Literal["billing", "delivery", "account", "technical", "other"]
    refund_requested: bool = Field(description="Does the customer ask for money back?")


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is 22 degrees and sunny in {city}."


WEATHER = FunctionTool.from_defaults(fn=get_weather)


def test_pcd_program_without_llm_uses_a_minicpm_llm(monkeypatch):
    monkeypatch.setattr(Settings, "_llm", None)
    program = MiniCPMPCDProgram.from_defaults(Ticket, prompt_template_str="{text}")
    assert isinstance(program._llm, MiniCPMLLM) and program._llm.model == MINICPM5_2B.hub_id
    assert program._llm.engine is None  # loaded on first use, not here
    configured = MiniCPMLLM(model="configured/model")
    monkeypatch.setattr(Settings, "_llm", configured)
    assert MiniCPMPCDProgram.from_defaults(Ticket, prompt_template_str="{text}")._llm is configured


pytestmark_slow = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> MiniCPMLLM:
    return MiniCPMLLM(engine=smollm2_engine(), model="SmolLM2-135M-Instruct", max_tokens=24)


@pytestmark_slow
def test_function_calling_program_equals_the_pcd_program(llm):
    program = FunctionCallingProgram.from_defaults(output_cls=Ticket, prompt_template_str="{text}", llm=llm)
    pcd = MiniCPMPCDProgram.from_defaults(Ticket, prompt_template_str="{text}", llm=llm)
    assert program(text=TEXT) == pcd(text=TEXT)


@pytestmark_slow
def test_text_completion_program_is_answered_by_the_engine(llm, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("free generation: the engine should have answered the parser's schema")

    expected = MiniCPMPCDProgram.from_defaults(Ticket, prompt_template_str="{text}", llm=llm)(text=TEXT)
    monkeypatch.setattr(llm.engine, "generate", refuse)
    program = LLMTextCompletionProgram.from_defaults(output_cls=Ticket, prompt_template_str="{text}", llm=llm)
    answer = program(text=TEXT)
    assert isinstance(answer, Ticket) and answer.topic == expected.topic


@pytestmark_slow
def test_chat_with_tools_gives_a_call_with_probabilities(llm):
    response = llm.chat_with_tools([WEATHER], user_msg="What's the weather in Paris?", tool_required=True)
    (call,) = llm.get_tool_calls_from_response(response)
    assert call.tool_name == "get_weather" and set(call.tool_kwargs) == {"city"} and call.tool_id
    assert response.raw["pcd"]["tool"] == "get_weather"
    streamed = list(
        llm.stream_chat_with_tools([WEATHER], user_msg="What's the weather in Paris?", tool_required=True)
    )
    assert llm.get_tool_calls_from_response(streamed[-1])[0].tool_kwargs == call.tool_kwargs
    text = llm.chat_with_tools([WEATHER], user_msg="Hi", tool_choice="none")
    assert llm.get_tool_calls_from_response(text, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="Expected at least one tool call"):
        llm.get_tool_calls_from_response(text)


@pytestmark_slow
def test_predict_and_call_runs_the_chosen_tool(llm):
    response = llm.predict_and_call([WEATHER], "What's the weather in Paris?")
    assert "22 degrees" in str(response)


@pytestmark_slow
async def test_function_agent_calls_a_tool_then_answers(llm):
    agent = FunctionAgent(tools=[WEATHER], llm=llm)
    out = await agent.run("What's the weather in Paris?", max_iterations=4)
    (call,) = out.tool_calls
    assert call.tool_name == "get_weather" and "22 degrees" in call.tool_output.content
    assert not [b for b in out.response.blocks if isinstance(b, ToolCallBlock)]  # the final answer is text
    assert isinstance(out.response, ChatMessage) and out.response.content
