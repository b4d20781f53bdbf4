"""OpenAI's embeddings (`POST /v1/embeddings`) on a real server, through the official `openai`
client, on a tiny random Qwen3 saved as Qwen3-Embedding is (a sentence-transformers folder:
last-token pooling, normalised): each vector equals transformers' `last_hidden_state` pooled
the same way (and the mean, with `--pooling mean`) within 1e-5 in float32, whether sent alone,
in a batch, as text or as token ids, whole or in prefill chunks, base64 or floats. Refusals by
raw HTTP: what is malformed or past a limit (10,000 inputs, a bad format, an input past the
context) is a 400 naming the field and the limit; generation on an embedding server and
embeddings on a generating one are refused; a client that goes away aborts every input at once.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from grpclib import GRPCError, Status
from grpclib.client import Channel
from transformers import AutoModel

from loom.core.config import SchedulerConfig
from loom.core.speculative import SpeculativeConfig
from loom.model.family import UnsupportedModelError
from loom.model.loader import LoadedModel, ModelConfig
from loom.model.pooling_config import read_sentence_transformers
from loom.server.openai.config import HttpConfig
from loom.smg import vllm_engine_pb2 as vllm
from loom.smg.vllm_engine_grpc import VllmEngineStub
from tests.conftest import saved_tiny
from tests.support.faults import calling_before_each_step
from tests.support.grpc_client import HOST, in_asyncio
from tests.support.http_client import openai_client, post
from tests.support.server_harness import closed_mid_answer, serving

HTTP = HttpConfig(http_port=0)
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "a"]
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> Path:
    """A tiny random Qwen3 in Qwen3-Embedding's folder layout."""
    folder = tmp_path_factory.mktemp("tiny-qwen3-embedding")
    saved_tiny(folder, "qwen3", smollm2_tokenizer)
    (folder / "modules.json").write_text(json.dumps(MODULES))
    (folder / "1_Pooling").mkdir()
    modes = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": False}
    modes |= {"pooling_mode_cls_token": False, "pooling_mode_lasttoken": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    (folder / "2_Normalize").mkdir()
    return folder


def load(folder: Path, **flags: Any) -> LoadedModel:
    return ModelConfig(model=str(folder), dtype="float32", device="cpu", **flags).load()


def reference(folder: Path, ids: list[int], mean: bool = False) -> list[float]:
    """transformers' last hidden states of `ids`, pooled (last or mean) and normalised."""
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    pooled = hidden.mean(0) if mean else hidden[-1]
    return torch.nn.functional.normalize(pooled, dim=0).tolist()


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


@pytest.mark.parametrize("pooling", ["last", "mean"])
async def test_embeddings_equal_transformers_pooled_states_alone_batched_and_chunked(
    embedder: Path, smollm2_tokenizer: Any, pooling: str
) -> None:
    mean = pooling == "mean"
    loaded = load(embedder, pooling=None if pooling == "last" else pooling)
    ids = [smollm2_tokenizer(text)["input_ids"] for text in TEXTS]
    long_ids = [(i * 37) % 1000 + 5 for i in range(150)]
    expected = [reference(embedder, i, mean) for i in [*ids, long_ids]]
    # A budget of 32 tokens a step: the long input is pooled over five prefill chunks.
    async with serving(loaded, http=HTTP, scheduler=SchedulerConfig(max_num_batched_tokens=32)) as (
        s,
        _,
    ):
        client = openai_client(s.http_port or 0)

        def ask() -> dict[str, list[list[float]]]:
            def vectors(**kwargs: Any) -> list[list[float]]:
                answer = client.embeddings.create(model=embedder.name, **kwargs)
                assert [d.index for d in answer.data] == list(range(len(answer.data)))
                return [list(d.embedding) for d in answer.data]

            return {
                "batch": vectors(input=TEXTS, encoding_format="float"),
                "singles": [vectors(input=t)[0] for t in TEXTS],  # base64, the client's default
                "ids": vectors(input=[*ids, long_ids], encoding_format="float"),
            }

        got = await trio.to_thread.run_sync(ask)
    for way in ("batch", "singles", "ids"):
        assert all(close(a, b) for a, b in zip(got[way], expected, strict=False)), way
    for want in expected:
        assert math.isclose(sum(v * v for v in want), 1.0, rel_tol=1e-5)
    assert close(got["ids"][3], expected[3])


async def test_embeddings_usage_dimensions_and_raw_vectors(
    embedder: Path, smollm2_tokenizer: Any
) -> None:
    """Usage counts every input's tokens; `dimensions` cuts a Matryoshka model's vector before
    normalising it, and is refused for another model; vLLM's `normalize: false` gives the
    pooled state itself."""
    ids = smollm2_tokenizer(TEXTS[0])["input_ids"]
    model = AutoModel.from_pretrained(str(embedder), dtype=torch.float32).eval()
    with torch.no_grad():
        raw = model(torch.tensor([ids])).last_hidden_state[0, -1]
    for matryoshka in (False, True):
        async with serving(load(embedder, matryoshka=matryoshka), http=HTTP) as (s, _):
            port = s.http_port or 0
            body = {"input": [ids, ids], "dimensions": 16}
            status, _, data = await post(port, "/v1/embeddings", body)
            if not matryoshka:
                assert status == 400, data
                assert json.loads(data)["error"]["param"] == "dimensions"
                assert b"Matryoshka" in data
                status, _, data = await post(
                    port, "/v1/embeddings", {"input": ids, "normalize": False}
                )
                assert status == 200, data
                assert close(json.loads(data)["data"][0]["embedding"], raw.tolist())
                continue
            assert status == 200, data
            answer = json.loads(data)
            assert answer["usage"] == {"prompt_tokens": 2 * len(ids), "total_tokens": 2 * len(ids)}
            cut = torch.nn.functional.normalize(raw[:16], dim=0).tolist()
            assert all(close(d["embedding"], cut) for d in answer["data"])


def hostile_bodies(ids: list[int]) -> Iterator[tuple[dict[str, Any], str, str]]:
    """(body, the field named, what the message says) for each refusal."""
    yield {"input": ["x"] * 10_000}, "input", "the limit is 128"
    yield {"input": []}, "input", "non-empty"
    yield {"input": ["ok", ""]}, "input", "non-empty"
    yield {"input": [[1, 2], "mixed"]}, "input", "non-empty"
    yield {"input": "hi", "encoding_format": "int8"}, "encoding_format", "float, base64"
    yield {"input": "hi", "dimensions": 0}, "dimensions", "[1, 1048576]"
    yield {"input": "hi", "dimensions": 65}, "dimensions", "[1, 64]"
    yield {"input": "hi", "normalize": "yes"}, "normalize", "true or false"
    yield {"input": [ids[0]] * 600}, "input", "512"  # past the context
    yield {"input": [10**9]}, "input", "vocabulary"
    yield {"input": "hi", "model": "gpt-4"}, "model", "does not exist"


async def test_embedding_refusals_name_the_field_and_limit(
    embedder: Path, smollm2_tokenizer: Any
) -> None:
    ids = smollm2_tokenizer(TEXTS[0])["input_ids"]
    async with serving(load(embedder), http=HTTP) as (s, _):
        port = s.http_port or 0
        for body, field, said in hostile_bodies(ids):
            status, _, data = await post(port, "/v1/embeddings", body)
            error = json.loads(data)["error"]
            assert status in (400, 404), (body, data)
            assert error["param"] == field, (body, error)
            assert said in error["message"], (body, error)
        # An embedding model generates nothing; a generating model pools nothing.
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, _, data = await post(port, "/v1/chat/completions", chat)
        assert status == 400, data
        assert b"embeddings only" in data
        assert json.loads(data)["error"]["param"] == "model"
    async with serving(load(embedder, task="generate"), http=HTTP) as (s, _):
        status, _, data = await post(s.http_port or 0, "/v1/embeddings", {"input": "hi"})
        assert status == 400, data
        assert b"--task embed" in data
        assert json.loads(data)["error"]["param"] == "model"


async def test_any_model_embeds_with_task_embed(tiny_folder: Path, smollm2_tokenizer: Any) -> None:
    """--task embed: a plain causal LM pools its last token, normalised."""
    ids = smollm2_tokenizer(TEXTS[1])["input_ids"]
    async with serving(load(tiny_folder, task="embed"), http=HTTP) as (s, _):
        status, _, data = await post(s.http_port or 0, "/v1/embeddings", {"input": TEXTS[1]})
    assert status == 200, data
    assert close(json.loads(data)["data"][0]["embedding"], reference(tiny_folder, ids))


async def test_a_client_that_goes_away_aborts_every_input_at_once(embedder: Path) -> None:
    """A batch whose inputs take 50 steps each (an 8-token step budget, 10 ms a step); the
    client closes its connection as the first runs: every one is aborted, its blocks freed."""
    body = {"input": [[(i * 7 + j) % 900 + 3 for j in range(400)] for i in range(4)]}
    slow = calling_before_each_step(lambda _: time.sleep(0.01))
    budget = SchedulerConfig(max_num_batched_tokens=8)
    async with serving(load(embedder), slow, http=HTTP, scheduler=budget) as (server, _):
        with trio.fail_after(30):
            seconds = await closed_mid_answer(server, "/v1/embeddings", body)
        assert seconds < 0.5
        assert server.engine.stats().finished == {"aborted": 4}


async def vllm_embed(port: int, ids: list[int]) -> vllm.EmbedResponse:
    async with Channel(HOST, port) as channel:
        tokenized = vllm.TokenizedInput(input_ids=ids)
        request = vllm.EmbedRequest(request_id="e-1", tokenized=tokenized)
        return await VllmEngineStub(channel).Embed(request, timeout=20)


async def test_embed_on_the_vllm_protocol_gives_the_http_vector(
    embedder: Path, tiny_folder: Path, smollm2_tokenizer: Any
) -> None:
    """The SMG gateway's Embed: the vector /v1/embeddings gives; a generating model refuses."""
    ids = smollm2_tokenizer(TEXTS[1])["input_ids"]
    async with serving(load(embedder), http=HTTP) as (server, port):
        with trio.fail_after(30):
            reply = await in_asyncio(vllm_embed, port, ids)
            _, _, data = await post(server.http_port or 0, "/v1/embeddings", {"input": ids})
    assert (reply.prompt_tokens, reply.embedding_dim) == (len(ids), 64)
    assert close(list(reply.embedding), json.loads(data)["data"][0]["embedding"])
    assert close(list(reply.embedding), reference(embedder, ids))
    async with serving(load(tiny_folder), http=HTTP) as (server, port):
        with trio.fail_after(30), pytest.raises(GRPCError) as refused:
            await in_asyncio(vllm_embed, port, ids)
    assert refused.value.status is Status.INVALID_ARGUMENT
    assert "--task embed" in (refused.value.message or "")


async def test_drafts_never_join_a_pooled_prompt(embedder: Path) -> None:
    """With n-gram speculation on, a prompt whose last chunk is one token (33 tokens, 32 a
    step) and which repeats itself (so that lookup finds drafts): the mean is the prompt's."""
    ids = [5, 6, 7] * 11
    ngram = SpeculativeConfig(speculative_method="ngram", prompt_lookup_min=1)
    budget = SchedulerConfig(max_num_batched_tokens=32, speculative=ngram)
    async with serving(load(embedder, pooling="mean"), http=HTTP, scheduler=budget) as (s, _):
        status, _, data = await post(s.http_port or 0, "/v1/embeddings", {"input": ids})
    assert status == 200, data
    assert close(json.loads(data)["data"][0]["embedding"], reference(embedder, ids, mean=True))


async def test_a_prompt_may_fill_the_context(embedder: Path) -> None:
    """An embedding generates nothing: a prompt of the whole context (512) is served."""
    async with serving(load(embedder), http=HTTP) as (s, _):
        body = {"input": [[(j * 11) % 900 + 3 for j in range(n)] for n in (512, 513)]}
        status, _, data = await post(s.http_port or 0, "/v1/embeddings", body)
        assert status == 400, data
        assert b"input has 513 items; the limit is 512" in data
        body["input"] = body["input"][:1]
        status, _, data = await post(s.http_port or 0, "/v1/embeddings", body)
    assert status == 200, data


def test_sentence_transformers_modules_loom_does_not_compute_are_refused(
    embedder: Path, tmp_path: Path
) -> None:
    """A Dense module after the pooling, or a pooling without the prompt: refused by name,
    never served with vectors that are not the model's."""
    dense = [*MODULES, {"idx": 3, "name": "3", "path": "3_Dense", "type": "x.models.Dense"}]
    (tmp_path / "modules.json").write_text(json.dumps(dense))
    with pytest.raises(UnsupportedModelError, match="not Dense"):
        read_sentence_transformers(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps(MODULES))
    (tmp_path / "1_Pooling").mkdir()
    modes = {"pooling_mode_lasttoken": True, "include_prompt": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    with pytest.raises(UnsupportedModelError, match="without the prompt"):
        read_sentence_transformers(tmp_path)
    assert read_sentence_transformers(embedder) == ("last", True)
