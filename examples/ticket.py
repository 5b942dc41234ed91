"""The support-ticket schema used by the README's quickstart.

pcd classify --schema examples/ticket.py:Ticket --input examples/tickets.txt --output out/tickets.jsonl
"""

from typing import Literal

from pydantic import BaseModel, Field


class Ticket(BaseModel):
    """A customer-support message to route."""

    topic: Literal["billing", "delivery", "account", "technical", "other"] = Field(
        description="What the customer needs help with."
    )
    sentiment: Literal["positive", "neutral", "negative"] = Field(description="The customer's mood.")
    refund_requested: bool = Field(description="Does the customer ask for money back?")
    urgent: bool = Field(description="Does the customer need an answer today?")


class TriagedTicket(BaseModel):
    """A customer-support message to route, with a short summary for the agent."""

    topic: Literal["billing", "delivery", "account", "technical", "other"] = Field(
        description="What the customer needs help with."
    )
    refund_requested: bool = Field(description="Does the customer ask for money back?")
    summary: str = Field(max_length=100, description="One sentence for the agent.")  # generated
    priority: int = Field(ge=1, le=5, description="1 = can wait, 5 = answer now.")  # scored
