"""LlamaIndex: a Workflow step that classifies incoming tickets with the PCD program, and a response
synthesizer with `output_cls` over a few text nodes.

    pip install -e ".[llama-index,gguf]" && python examples/llama_index_workflow.py
"""

import asyncio
from pathlib import Path
from typing import Literal

from llama_index.core import get_response_synthesizer
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.core.workflow import StartEvent, StopEvent, Workflow, step
from pydantic import BaseModel, Field
from ticket import Ticket  # examples/ticket.py

from minicpm_pcd_adapters import MiniCPMLLM, MiniCPMPCDProgram, load_smollm2

# MiniCPMLLM() alone loads MiniCPM5-2B at the pinned revision; here the offline SmolLM2 engine.
llm = MiniCPMLLM(engine=load_smollm2(), model="SmolLM2-135M-Instruct")
program = MiniCPMPCDProgram.from_defaults(
    Ticket, prompt_template_str="Route this customer message:\n{ticket}", llm=llm
)


class TicketTriage(Workflow):
    @step
    async def classify(self, ev: StartEvent) -> StopEvent:
        routed = []
        for text in ev.tickets:
            ticket = await program.acall(ticket=text)
            topic = program.last_result.fields["topic"]  # per-field probabilities of that answer
            routed.append((text, ticket, topic.confidence))
        return StopEvent(result=routed)


class Verdict(BaseModel):
    topic: Literal["billing", "delivery", "account", "technical", "other"] = Field(
        description="What the notes are about."
    )
    needs_refund: bool


async def main() -> None:
    tickets = Path(__file__).with_name("tickets.txt").read_text().splitlines()[:4]
    for text, ticket, confidence in await TicketTriage(timeout=600).run(tickets=tickets):
        print(f"{text[:40]!r}: {ticket!r} (topic p={confidence:.2f})")

    notes = ["Customer was charged twice for order 4412.", "They ask for the second payment back."]
    synthesizer = get_response_synthesizer(llm=llm, output_cls=Verdict, response_mode="compact")
    nodes = [NodeWithScore(node=TextNode(text=note), score=1.0) for note in notes]
    print(synthesizer.synthesize("What is this ticket about?", nodes=nodes).response)


if __name__ == "__main__":
    asyncio.run(main())
