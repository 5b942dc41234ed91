"""Ray Serve on a real local cluster: `pcd_application` with one replica behind Serve's proxy on
127.0.0.1, answering the `openai` SDK as the plain server does."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
import ray
from ray import serve

from minicpm_pcd_adapters.ray.serve import pcd_application
from minicpm_pcd_adapters.server.settings import ServerSettings
from pcd_engine import PCDEngine
from tests.helpers import ROUTE


@pytest.fixture(scope="module")
def url(tiny_folder):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with socket.socket() as sock:  # after ray.init: Ray's own processes have taken their ports
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = ServerSettings(model_name="tiny", api_key="k")
    serve.run(pcd_application(tiny_folder, settings, replicas=1), name="pcd", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def test_a_serve_replica_answers_the_openai_sdk_like_the_engine(url, tiny_folder):
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    text = "The app crashes when I log in."
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": text}],
        response_format={"type": "json_schema", "json_schema": {"name": "Route", "schema": ROUTE}},
    )
    reference = PCDEngine.from_pretrained(tiny_folder).classify(text, ROUTE)
    assert json.loads(response.choices[0].message.content) == reference.value
    topic = response.choices[0].pcd["fields"]["topic"]["probabilities"]
    for value, p in reference.fields["topic"].probabilities.items():
        assert topic[value] == pytest.approx(p, abs=1e-4)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(url + "/v1/models").status_code == 401  # the replica's key check holds
    streamed = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True
    )
    assert sum(1 for _ in streamed) >= 2
