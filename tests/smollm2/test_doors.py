"""One conversation, every door: the same conversation (a system message, then user, assistant, user)
gets the same prompt and the same probabilities through the engine, LangChain (structured output and a
forced tool), LlamaIndex (a program and a forced tool) and `pcd serve` (a response format, a forced
tool and Ollama's `format`); aliased models work at every door; agent loops answer a tool's result in
words. SmolLM2 (CPU), one server for the module, driven by the official clients."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.prompts import ChatPromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, ConfigDict, Field

from minicpm_pcd_adapters import ChatMiniCPM, MiniCPMLLM, MiniCPMPCDProgram
from pcd_engine import Conversation
from tests.helpers import KEY

pytestmark = pytest.mark.slow
SYSTEM = "You route customer-support messages."
TURNS = [
    ("user", "Hi, I have a question about my account."),
    ("assistant", "Sure, what is it?"),
    ("user", "I was charged twice this month, please refund me."),
]
MESSAGES = [{"role": "system", "content": SYSTEM}] + [{"role": r, "content": c} for r, c in TURNS]


class Ticket(BaseModel):
    """A customer-support message to route."""

    topic: Literal["billing", "delivery", "account", "technical", "other"]
    refund_requested: bool = Field(description="Does the customer ask for money back?")


class Aliased(BaseModel):
    """A customer-support message to route."""

    topic: Literal["billing", "delivery", "other"] = Field(alias="Topic", title="The topic")
    refund: bool = Field(serialization_alias="Refund", description="Money back?")


class Populated(Aliased):
    model_config = ConfigDict(populate_by_name=True)


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is 22 degrees and sunny in {city}."


CALLED = "get_weather"
ASKED = "What's the weather in Paris?"


@pytest.fixture(scope="module")
def chat(engine):
    return ChatMiniCPM(engine=engine, model="smollm2", max_tokens=40)


@pytest.fixture(scope="module")
def llm(engine):
    return MiniCPMLLM(engine=engine, model="smollm2", max_tokens=40)


def probabilities(fields):
    """{path: {value: probability}} of a door's JSON fields (the `pcd` extensions)."""
    return {path: field["probabilities"] for path, field in fields.items()}


def assert_same(got, reference):
    assert set(got) == set(reference)
    for path, values in reference.items():
        assert got[path] == pytest.approx(values, abs=1e-4), path


def test_one_conversation_gets_the_same_probabilities_through_every_door(engine, chat, llm, client, url):
    result = engine.classify(Conversation.of(MESSAGES), Ticket)
    reference = probabilities(result.to_json()["fields"])
    lc_messages = [
        SystemMessage(SYSTEM),
        HumanMessage(TURNS[0][1]),
        AIMessage(TURNS[1][1]),
        HumanMessage(TURNS[2][1]),
    ]
    structured = chat.with_structured_output(Ticket, include_raw=True).invoke(lc_messages)
    assert structured["parsed"] == result.value
    assert_same(probabilities(structured["raw"].response_metadata["pcd"]["fields"]), reference)
    forced = chat.bind_tools([Ticket], tool_choice="Ticket").invoke(lc_messages)
    assert forced.tool_calls[0]["args"] == result.value.model_dump()
    assert_same(probabilities(forced.response_metadata["pcd"]["arguments"]), reference)

    li_messages = [ChatMessage(role=role, content=content) for role, content in [("system", SYSTEM), *TURNS]]
    program = MiniCPMPCDProgram(Ticket, ChatPromptTemplate(message_templates=li_messages), llm)
    assert program() == result.value
    assert program.last_result is not None
    assert_same(probabilities(program.last_result.to_json()["fields"]), reference)
    tool = FunctionTool.from_defaults(fn=lambda **kw: kw, name="Ticket", fn_schema=Ticket)
    response = llm.chat_with_tools([tool], chat_history=li_messages, tool_required=True)
    assert_same(probabilities(response.raw["pcd"]["arguments"]), reference)

    schema = {"name": "Ticket", "schema": Ticket.model_json_schema()}
    answered = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, response_format={"type": "json_schema", "json_schema": schema}
    )
    assert json.loads(answered.choices[0].message.content) == result.to_json()["value"]
    assert_same(probabilities(answered.choices[0].pcd["fields"]), reference)
    function = {"name": "Ticket", "description": Ticket.__doc__, "parameters": Ticket.model_json_schema()}
    called = client.chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        tools=[{"type": "function", "function": function}],
        tool_choice={"type": "function", "function": {"name": "Ticket"}},
    )
    (call,) = called.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == result.to_json()["value"]
    assert call.id == called.choices[0].pcd["call_id"]
    assert_same(probabilities(called.choices[0].pcd["arguments"]), reference)

    ollama = httpx.post(  # Ollama's API, its `format` a JSON schema
        url.removesuffix("/v1") + "/api/chat",
        json={
            "model": "smollm2",
            "messages": MESSAGES,
            "format": Ticket.model_json_schema(),
            "stream": False,
        },
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=300,
    ).json()
    assert json.loads(ollama["message"]["content"]) == result.to_json()["value"]
    assert_same(probabilities(ollama["pcd"]["fields"]), reference)


@pytest.mark.parametrize("model", [Aliased, Populated])
def test_aliased_models_work_at_every_door(engine, chat, llm, client, model):
    text = "I was charged twice, please give my money back."
    expected = engine.classify(text, model).value
    assert isinstance(expected, model)
    assert chat.with_structured_output(model).invoke(text) == expected
    program = MiniCPMPCDProgram.from_defaults(model, prompt_template_str="{text}", llm=llm)
    assert program(text=text) == expected
    parsed = client.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": text}], response_format=model
    )
    assert parsed.choices[0].message.parsed == expected
    dumped = engine.classify(text, model).to_json()["value"]
    assert set(dumped) == {"Topic", "Refund"}  # the user's own aliases, as model_dump(by_alias=True)


def repeats_the_call(text: str) -> bool:
    """Whether a final answer writes the tool call again (its name, or a JSON object)."""
    return CALLED in text or '"city"' in text or text.lstrip().startswith("{")


def test_a_langchain_agent_answers_the_tool_result_in_words(chat):
    agent = create_agent(model=chat, tools=[get_weather])
    out = agent.invoke({"messages": [{"role": "user", "content": ASKED}]}, {"recursion_limit": 8})
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert out["messages"][1].tool_calls[0]["name"] == CALLED and "22 degrees" in out["messages"][2].content
    answer = out["messages"][-1]
    assert isinstance(answer.content, str) and answer.content.strip()
    assert not repeats_the_call(answer.content), answer.content


async def test_a_llama_index_agent_answers_the_tool_result_in_words(llm):
    from llama_index.core.agent.workflow import FunctionAgent

    agent = FunctionAgent(tools=[FunctionTool.from_defaults(fn=get_weather)], llm=llm)
    out = await agent.run(ASKED, max_iterations=4)
    assert [c.tool_name for c in out.tool_calls] == [CALLED]
    assert out.response.content and not repeats_the_call(out.response.content), out.response.content


def test_an_ollama_agent_loop_answers_the_tool_result_in_words(url):
    import ollama

    client = ollama.Client(host=url.removesuffix("/v1"), headers={"Authorization": f"Bearer {KEY}"})
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": CALLED, "parameters": parameters}}]
    messages: list = [{"role": "user", "content": ASKED}]
    first = client.chat(model="smollm2", messages=messages, tools=tools, options={"num_predict": 40})
    (call,) = first.message.tool_calls
    assert call.function.name == CALLED
    messages += [
        first.message,
        {"role": "tool", "tool_name": CALLED, "content": get_weather(**call.function.arguments)},
    ]
    second = client.chat(model="smollm2", messages=messages, tools=tools, options={"num_predict": 40})
    assert not second.message.tool_calls and second.message.content
    assert not repeats_the_call(second.message.content), second.message.content


def test_an_http_agent_loop_answers_the_tool_result_in_words(client):
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": CALLED, "parameters": parameters}}]
    messages: list[dict] = [{"role": "user", "content": ASKED}]
    first = client.chat.completions.create(model="smollm2", messages=messages, tools=tools, max_tokens=40)
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == CALLED and call.id == first.choices[0].pcd["call_id"]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": get_weather(**json.loads(call.function.arguments)),
        },
    ]
    second = client.chat.completions.create(model="smollm2", messages=messages, tools=tools, max_tokens=40)
    answer = second.choices[0].message
    assert not answer.tool_calls and answer.content
    assert not repeats_the_call(answer.content), answer.content
    assert second.choices[0].pcd["probabilities"][""] > 0.5  # the decision: answer in text
