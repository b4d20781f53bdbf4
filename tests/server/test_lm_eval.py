"""A harness Loom did not write against the HTTP API: lm-eval's `local-completions` model
(`LocalCompletionsAPI`, as `lm_eval --model local-completions` builds it) scoring a small
multiple-choice task made here, on the real SmolLM2 in the exact mode. lm-eval sends each
context + continuation as token ids with `echo` and `logprobs`, and sums the continuation's
prompt log-probabilities: a server that returns none (llama.cpp #27174) scores at chance.

Rules: loopback only, port 0; lm-eval's client in a worker thread (the server runs in trio).
"""

from __future__ import annotations

import pytest
import torch
import trio
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

from loom.model.loader import (
    LoadedModel,
    converted_gguf_folder,
    default_model_path,
    model_cache_root,
)
from loom.server.openai.config import HttpConfig
from tests.support.server_harness import serving

TASK = [  # (context, choices, the right one)
    ("The capital of France is", [" Paris", " London", " Madrid"], 0),
    ("Two plus two equals", [" seven", " four", " nine"], 1),
    ("The opposite of hot is", [" blue", " loud", " cold"], 2),
    ("Monday, Tuesday,", [" Wednesday", " April", " green"], 0),
]


def score(port: int, model: str) -> list[tuple[float, bool]]:
    folder = converted_gguf_folder(default_model_path(), model_cache_root())
    lm = LocalCompletionsAPI(
        base_url=f"http://127.0.0.1:{port}/v1/completions",
        model=model,
        tokenizer=str(folder),
        num_concurrent=4,
        max_retries=1,
    )
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=(context, choice), idx=i)
        for context, choices, _ in TASK
        for i, choice in enumerate(choices)
    ]
    return [(float(lp), bool(greedy)) for lp, greedy in lm.loglikelihood(requests)]


def reference(loaded: LoadedModel) -> list[float]:
    """Each continuation's log-probability given its context, by transformers."""
    tokenizer, scores = loaded.tokenizer, []
    for context, choices, _ in TASK:
        for choice in choices:
            context_ids = tokenizer.encode(context)
            whole = tokenizer.encode(context + choice)
            with torch.inference_mode():
                logits = loaded.model(torch.tensor([whole])).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            scores.append(
                sum(logprobs[i - 1, whole[i]].item() for i in range(len(context_ids), len(whole)))
            )
    return scores


@pytest.mark.smollm2
async def test_lm_eval_local_completions_scores_a_task_as_transformers_does(
    smollm2: LoadedModel,
) -> None:
    async with serving(smollm2, http=HttpConfig(http_port=0)) as (server, _):  # the exact mode
        with trio.fail_after(300):
            scored = await trio.to_thread.run_sync(score, server.http_port, smollm2.name)
    expected = reference(smollm2)
    got = [lp for lp, _ in scored]
    print(f"lm-eval's loglikelihoods: {[round(g, 3) for g in got]}")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-3, atol=1e-3)
    picked = [max(range(3), key=lambda i, q=q: got[3 * q + i]) for q in range(len(TASK))]
    accuracy = sum(p == answer for p, (_, _, answer) in zip(picked, TASK, strict=True))
    print(f"accuracy {accuracy}/{len(TASK)}")
    assert accuracy >= 3  # a 135M model knows these; at chance it would get 1 or 2
    assert scored[0][1]  # " Paris" is what it would say: greedy
    assert not scored[1][1]
