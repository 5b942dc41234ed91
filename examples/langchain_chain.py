"""LangChain: `ChatPromptTemplate | llm.with_structured_output(Ticket)` over the sample tickets.

    pip install -e ".[langchain,gguf]" && python examples/langchain_chain.py

Prints each ticket's values and the confidence of its topic; the batch runs one engine batch.
"""

from pathlib import Path

from langchain_core.prompts import ChatPromptTemplate
from ticket import Ticket  # examples/ticket.py

from minicpm_pcd_adapters import ChatMiniCPM, load_smollm2

# ChatMiniCPM() alone loads MiniCPM5-2B at the pinned revision; here the offline SmolLM2 engine.
llm = ChatMiniCPM(engine=load_smollm2(), model="SmolLM2-135M-Instruct")
prompt = ChatPromptTemplate.from_messages(
    [("system", "Route the customer's message for the support team."), ("human", "{ticket}")]
)
chain = prompt | llm.with_structured_output(Ticket, include_raw=True)

tickets = Path(__file__).with_name("tickets.txt").read_text().splitlines()
for text, out in zip(tickets, chain.batch([{"ticket": t} for t in tickets]), strict=True):
    if out["parsing_error"] is not None:
        print(f"{text[:40]!r}: error {out['parsing_error']}")
        continue
    topic = out["raw"].response_metadata["pcd"]["fields"]["topic"]
    p = topic["probabilities"][topic["value"]]
    print(f"{text[:40]!r}: {out['parsed']!r} (topic p={p:.2f})")
