"""The real SmolLM2 (the default model, its q4 kernels) as a vllm.grpc.engine worker behind the
real SMG: the gateway templates the chat with the model's own chat template (from GetTokenizer),
and its greedy answers, plain and constrained to a JSON schema, are Loom's own.

Rules: one `loom serve --quantization q4` process with the default model; the gateway given no
tokenizer of its own; the official openai client, to the gateway and to the replica's API.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from openai import OpenAI

from loom.bench.serving import launched_process
from tests.support.grpc_client import HOST
from tests.support.smg_front import Gateway, smg_front

pytestmark = pytest.mark.smollm2
MODEL = "SmolLM2"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Gateway, int]]:
    """The gateway, and the replica's HTTP port."""
    args = ["--quantization", "q4", "--served-model-name", MODEL, "--http-port", "0"]
    ports: dict[str, int] = {}
    with ExitStack() as stack:
        grpc_port, _ = stack.enter_context(launched_process(args, ports=ports))
        yield stack.enter_context(smg_front([f"grpc://{HOST}:{grpc_port}"])), ports["http"]


def answer(url: str, **fields: Any) -> str:
    with OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=40,
            temperature=0,
            **fields,
        )
        return reply.choices[0].message.content or ""


def test_smg_answers_with_smollm2_as_loom_does(served: tuple[Gateway, int]) -> None:
    gateway, http_port = served
    own = answer(f"http://{HOST}:{http_port}")
    assert answer(gateway.url) == own
    assert len(own) > 20


def test_smg_json_schema_with_smollm2_as_loom_does(served: tuple[Gateway, int]) -> None:
    gateway, http_port = served
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    own = answer(f"http://{HOST}:{http_port}", response_format=response_format)
    assert answer(gateway.url, response_format=response_format) == own
    assert set(json.loads(own)) == {"city", "sunny"}
