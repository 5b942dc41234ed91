"""`pcd`: classify a file, evaluate on labeled data, fit a calibration, suggest texts to label, label
them with a stronger model, serve.

    pcd classify --schema examples/ticket.py:Ticket --input examples/tickets.txt \
        --output out/tickets.jsonl --model smollm2 [--calibration cal.json --abstain-below 0.6]
    pcd evaluate --schema ... --input labeled.jsonl --model smollm2 [--fit 50] [--examples 4]
    pcd calibrate --schema ... --input labeled.jsonl --output cal.json --model smollm2 [--method head]
    pcd suggest --schema ... --input unlabeled.jsonl --count 50 --output to_label.jsonl
    pcd label --schema ... --input to_label.jsonl --output labeled.jsonl \
        --teacher-url http://127.0.0.1:8001/v1 --teacher-model NAME  (teacher.py; [teacher])
    pcd classify --ray --actors 2 --schema ... --input folder/ --output answers/  (ray/files.py; [ray])
    pcd serve --model smollm2 [--port 8000 --api-key KEY]  (server/app.py; needs the [server] extra)
    pcd serve --ray --replicas 2 --model smollm2  (ray/serve.py; needs the [ray] extra)
    pcd manifest create /models/MiniCPM5-2B --output minicpm5.manifest.json  (then --manifest FILE)

`classify` input: `.jsonl`/`.ndjson`/`.json` files hold one JSON value per line (an object with a
`text` key, or a string); any other file is plain text, one input per line. Every input line gets one
output record with its line number (and `id`): its value and probabilities, or an error record. No
input is dropped. Inputs are read lazily and written a `--batch-size` chunk at a time (files.py);
`--resume` finishes an interrupted run; SIGINT / SIGTERM stop after the current chunk. Exit codes: 0
every input answered, 1 some inputs got error records, 2 usage, path or schema errors (before the
model loads), 130 stopped by a signal. `evaluate` and `calibrate` read labeled JSONL
(`{"text": ..., "label": {field: value}}`); `evaluate` writes report.html (the page to read),
report.json and PNG plots (reliability diagram, coverage vs accuracy) to `--report`.

One module per command (`classify.py`, `evaluate.py`, `calibrate.py`, `suggest.py`, `label.py`,
`serve.py`, `manifest.py`), each adding its own arguments (`add_parser`) and running them (`main`); what they
share is `options.py`, and the loaders every entry point shares are `minicpm_pcd_adapters.by_name`.
"""

from minicpm_pcd_adapters.cli.main import main

__all__ = ["main"]
