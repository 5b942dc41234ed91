"""Classify a few tickets with the offline SmolLM2 model and print values and confidences.

Then the same tickets with a mixed schema (a generated summary after the scored fields), and one
plain chat call.
"""

from pathlib import Path

from ticket import Ticket, TriagedTicket  # examples/ticket.py

from minicpm_pcd_adapters import load_smollm2

engine = load_smollm2()  # or: load_minicpm5() on a machine with the hub or a local copy
texts = Path(__file__).with_name("tickets.txt").read_text().splitlines()
for text in texts:
    result = engine.classify(text, Ticket)
    topic = result.fields["topic"]
    print(f"{result.value!r}\n    topic={topic.value} p={topic.confidence:.2f} margin={topic.margin:.2f}")

for result in engine.classify_batch(texts[:4], TriagedTicket, return_exceptions=True):
    print(result if isinstance(result, Exception) else result.value)

print(engine.generate([{"role": "user", "content": "Say hello in French."}], max_tokens=16).text)
