"""Classify a few tickets with the offline SmolLM2 model and print values and confidences."""

from pathlib import Path

from ticket import Ticket  # examples/ticket.py

from minicpm_pcd_adapters import load_smollm2

engine = load_smollm2()  # or: load_minicpm5() on a machine with the hub or a local copy
for text in Path(__file__).with_name("tickets.txt").read_text().splitlines():
    result = engine.classify(text, Ticket)
    topic = result.fields["topic"]
    print(f"{result.value!r}\n    topic={topic.value} p={topic.confidence:.2f} margin={topic.margin:.2f}")
