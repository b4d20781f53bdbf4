"""The HTTP front's settings: where it listens and what one HTTP request may ask for. The
connection caps, timeouts and the body budget are the network boundary's
(loom/server/boundary.py), shared with the gRPC front."""

from __future__ import annotations

import attrs

from loom.core.setting import at_least, in_range, setting
from loom.server.openai.reasoning import PARSERS


def names(text: str) -> tuple[str, ...]:
    """`a, b` -> ("a", "b")."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


@attrs.frozen(kw_only=True)
class HttpConfig:
    http_port: int | None = setting(
        None,
        "serve OpenAI's HTTP API (/v1/chat/completions, /v1/completions, ...) on this port "
        "too, on the same engine (0 picks a free one)",
        check=in_range(0, 65535),
    )
    http_host: str = setting("127.0.0.1", "address the HTTP API listens on")
    max_choices: int = setting(
        16,
        "most sequences one request may ask for (HTTP: n times its prompts; vllm.grpc.engine: n)",
        check=at_least(1),
    )
    max_embedding_inputs: int = setting(
        128,
        "most inputs one /v1/embeddings request may hold (each takes a place in the queue: "
        "never more than --max-waiting-requests)",
        check=at_least(1),
    )
    served_model_name: str | None = setting(
        None,
        "the model's name in the HTTP API and to a gateway (vllm.grpc.engine's GetModelInfo) "
        "(default: the loaded model's own)",
    )
    allowed_hosts: tuple[str, ...] | None = setting(
        None,
        "comma-separated Host names the HTTP API answers to (`.example.com`: a domain and its "
        "subdomains; `*`: any); by default localhost names and IP addresses when it listens "
        "on loopback, any name otherwise (against DNS rebinding)",
        parse=names,
    )
    allowed_origins: tuple[str, ...] = setting(
        (),
        "comma-separated web origins (`https://app.example.com`, or `*`) whose pages may call "
        "the HTTP API from a browser (CORS); by default none",
        parse=names,
    )
    reasoning_parser: str | None = setting(
        None,
        "split a reasoning model's thinking from its answer in chat responses "
        "(`reasoning_content`, streamed too): qwen3 (`<think>...</think>` the model opens) or "
        "deepseek_r1 (thinking until `</think>`); by default none, all is content",
        choices=PARSERS,
    )
    web_ui: bool = setting(True, "serve the web page at / (a live dashboard and a chat playground)")
