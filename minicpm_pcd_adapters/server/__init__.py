"""`pcd serve`: the engine behind the OpenAI Chat Completions and Completions protocols.

app.py               the FastAPI routes, the model worker, start-up checks (`create_app`)
protocol.py          the Chat Completions request and answer models: what a body may hold, what
                     every answer holds, and what /openapi.json publishes (one source)
calls.py             a Chat Completions body as a checked call: classify, tool decision or generate
text_completions.py  the Completions protocol (`/v1/completions`), on the same calls
constraints.py       vLLM's, SGLang's and llama.cpp's constrained-decoding fields, read as one
answers.py           the answers built from the engine's results (`protocol` models)
errors.py            OpenAI's error body and reading a body into its model
batching.py          requests from different callers batched together, one model worker
jobs.py              cancellation when a client leaves, engine errors as HTTP errors, SSE
guard.py             the bearer key and the body-size limit
calibrations.py      calibrations the server loads and applies by schema
metrics.py           Prometheus metrics
memory.py            freed memory handed back to the system once the caches have evicted enough
settings.py          everything `pcd serve` is started with
openapi.py           the OpenAPI document
"""
