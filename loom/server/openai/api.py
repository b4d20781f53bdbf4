"""The routes of OpenAI's HTTP API (and vLLM's tokenizer routes), handled on the engine the
gRPC front serves, through the same relay, tenants and limits.

    POST /v1/chat/completions  POST /v1/completions   (streamed as SSE with "stream": true)
    POST /v1/responses         (stateless: loom/server/openai/responses_input.py)
    POST /v1/embeddings        (an embedding model's: loom/server/openai/embeddings.py)
    GET  /v1/models            GET  /v1/models/{id}
    POST /tokenize             POST /detokenize
    GET  /health               GET  /version
    GET  /v1/loads             GET  /metrics          (for a gateway: loom/server/openai/loads.py)
    GET  /                     GET  /stats            (the page: loom/server/openai/web.py)

Headers: `Authorization: Bearer KEY` (with --api-key-file), `X-Request-Id` and
`X-Request-Timeout` (loom/server/openai/exchange.py).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from loom.core.tenancy import Tenancy
from loom.engine.engine import Engine, EngineState
from loom.server.boundary import BoundaryConfig
from loom.server.bridge import TrioBridge
from loom.server.openai.config import HttpConfig
from loom.server.openai.embeddings import EmbeddingsAsk, EmbeddingsFraming, embeddings_ask
from loom.server.openai.errors import HttpError, StreamEndedError, http_errors
from loom.server.openai.exchange import Exchange, reply_error
from loom.server.openai.loads import PROMETHEUS_TEXT, LoadReports
from loom.server.openai.message import HttpRequest
from loom.server.openai.origin_policy import OriginPolicy
from loom.server.openai.requests import (
    Ask,
    chat_ask,
    completion_ask,
    detokenize_tokens,
    echoes,
    tokenize_prompt,
)
from loom.server.openai.responses import OpenAIFraming
from loom.server.openai.responses_events import ResponsesFraming
from loom.server.openai.responses_input import ResponsesAsk, renamed, responses_ask
from loom.server.openai.tokens import TokenTexts
from loom.server.openai.tool_framing import ToolFraming
from loom.server.openai.web import FILES, NOT_STORED, WebPage, stats_document
from loom.server.relay import Framing, Live, Relay
from loom.server.tenants import HEALTH_PREFIX, Tenant, Tenants

Route = Callable[[HttpRequest, Exchange], Awaitable[Any]]


class OpenAIApi:
    def __init__(
        self,
        engine: Engine,
        bridge: TrioBridge,
        tenants: Tenants,
        live: Live,
        config: HttpConfig,
        boundary: BoundaryConfig,
    ) -> None:
        self.engine = engine
        self.bridge = bridge
        self.tenants = tenants
        self.live = live
        self.config = config
        self.boundary = boundary
        self.routes: dict[tuple[str, str], Route] = {
            ("POST", "/v1/chat/completions"): lambda r, e: self.generate(r, e, "chat"),
            ("POST", "/v1/completions"): lambda r, e: self.generate(r, e, "completions"),
            ("POST", "/v1/responses"): lambda r, e: self.generate(r, e, "responses"),
            ("POST", "/v1/embeddings"): lambda r, e: self.generate(r, e, "embeddings"),
            ("GET", "/v1/models"): self.models,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
            ("GET", "/health"): self.health,
            ("GET", "/version"): self.version,
            ("GET", "/v1/loads"): self.loads,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/stats"): self.stats,
        }
        if config.web_ui:  # the page (loom/server/openai/web.py)
            origins = OriginPolicy(config.http_host, config.allowed_hosts, config.allowed_origins)
            self.page = WebPage(origins)
            self.routes |= {("GET", path): self.page_file for path in FILES}
        self.reports = LoadReports(engine, bridge)

    async def __call__(self, request: HttpRequest, exchange: Exchange) -> None:
        """The front's handler (loom/server/openai/front.py): `exchange` is the request's."""
        route = self.routes.get((request.method, request.path))
        if route is None and request.method == "GET" and request.path.startswith("/v1/models/"):
            route = self.routes["GET", "/v1/models"]
        if route is None:
            known = any(path == request.path for _, path in self.routes)
            status, why = (405, "method not allowed") if known else (404, "no such route")
            error = HttpError(status, f"{request.method} {request.path}: {why}")
            await reply_error(exchange.response, error)
            return
        try:
            await route(request, exchange)
        except HttpError as exc:
            await reply_error(exchange.response, exc)

    # Generation

    async def generate(self, request: HttpRequest, exchange: Exchange, kind: str) -> None:
        """Chat completions, completions or a response (`kind`), streamed or whole."""
        done = exchange.counted()
        try:
            with http_errors():
                request_id = exchange.request_id()
                exchange.headers["X-Request-Id"] = request_id
                tenant = self.identify(request)
                ask = await exchange.read_json(self.boundary, self.reading(kind))
                exchange.stream = ask.stream
                model = self.check_model(ask.model)
                time_left = exchange.time_left()
                framing = self.framing(ask, kind, request_id, model)
                tenancy = Tenancy(
                    tenant=tenant.name, weight=tenant.weight, connection=f"http {request.peer}"
                )
                relay = Relay(exchange, framing, self.engine, self.bridge, self.live)
                await relay.run(request_id, ask.submissions(tenancy), time_left)
        except StreamEndedError:
            pass  # its error event has been sent
        except HttpError as exc:
            if kind == "responses":
                exc = renamed(exc)
            if not exchange.started:
                await reply_error(exchange.response, exc, exchange.headers)
                return
            await exchange.cancel()  # mid-stream, and no event for it: the client sees a cut
        finally:
            done()
        await exchange.finish()

    def reading(self, kind: str) -> Callable[[Any], Ask | EmbeddingsAsk]:
        """What reads a `kind` request's body into what it asks of the engine."""
        max_choices = self.config.max_choices
        reasoning = self.config.reasoning_parser  # a constraint binds after the thinking
        if kind == "chat":
            return partial(chat_ask, max_choices=max_choices, reasoning=reasoning)
        if kind == "responses":
            return partial(responses_ask, max_choices=max_choices, reasoning=reasoning)
        max_ids = self.engine.loaded_core().admission.prompts.max_model_len
        if kind == "embeddings":  # each input a place in the queue
            inputs = min(self.config.max_embedding_inputs, self.engine.config.max_waiting_requests)
            vocab = self.engine.loaded_core().runner.vocab_size
            return partial(embeddings_ask, max_inputs=inputs, max_ids=max_ids, vocab_size=vocab)
        return partial(completion_ask, max_choices=max_choices, max_ids=max_ids)

    def framing(self, ask: Ask | EmbeddingsAsk, kind: str, request_id: str, model: str) -> Framing:
        """How the relay frames what `ask` gets back, for the `kind` of request it is."""
        if isinstance(ask, EmbeddingsAsk):
            return EmbeddingsFraming(ask, request_id=request_id, model=model)
        tokenizer = self.tokenizer()
        tokens = TokenTexts(tokenizer, as_ids=ask.tokens_as_ids)
        if isinstance(ask, ResponsesAsk):
            reasoning = self.config.reasoning_parser
            return ResponsesFraming(
                ask, request_id=request_id, model=model, tokens=tokens, reasoning=reasoning
            )
        return (ToolFraming if ask.tools else OpenAIFraming)(
            ask,
            chat=kind == "chat",
            request_id=request_id,
            model=model,
            tokens=tokens,
            echoes=echoes(tokenizer, ask.prompts) if ask.echo else (),
            reasoning=self.config.reasoning_parser,
        )

    def identify(self, request: HttpRequest) -> Tenant:
        path = HEALTH_PREFIX if request.path == "/health" else request.path
        tenant = self.tenants.identify(path, request.headers, request.peer, request.cert)
        return tenant if tenant is not None else Tenant("")

    def check_model(self, model: str | None) -> str:
        name = self.model_name()
        if model is not None and model != name:
            raise HttpError(
                404,
                f"model {model!r} does not exist; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )
        return name

    def model_name(self) -> str:
        core = self.engine.core
        if core is None:
            raise HttpError(503, self.engine.refusal(), code="unavailable")
        return self.config.served_model_name or core.model_name

    def tokenizer(self) -> Any:
        core = self.engine.core
        return core.admission.prompts.tokenizer if core is not None else None

    # The other routes

    async def models(self, request: HttpRequest, exchange: Exchange) -> None:
        with http_errors():
            self.identify(request)
            name = self.model_name()
            info = await self.bridge.call(self.engine.model_info)
        card = {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "loom",
            "max_model_len": info.max_model_len,
        }
        if request.path.startswith("/v1/models/"):
            if request.path.removeprefix("/v1/models/") != name:
                raise HttpError(
                    404,
                    f"no model {request.path.removeprefix('/v1/models/')!r}",
                    code="model_not_found",
                )
            await reply_json(exchange, card)
        else:
            await reply_json(exchange, {"object": "list", "data": [card]})

    async def tokenize(self, request: HttpRequest, exchange: Exchange) -> None:
        with http_errors():
            self.identify(request)
            prompt = await exchange.read_json(self.boundary, tokenize_prompt)
            core = self.engine.loaded_core()
            checker = core.admission.prompts
            checker.check_size(prompt)
            loop = asyncio.get_running_loop()
            tokens = await loop.run_in_executor(None, checker.tokenize, prompt)
        await reply_json(
            exchange,
            {"count": len(tokens), "max_model_len": checker.max_model_len, "tokens": tokens},
        )

    async def detokenize(self, request: HttpRequest, exchange: Exchange) -> None:
        with http_errors():
            self.identify(request)
            checker = self.engine.loaded_core().admission.prompts
            tokens = await exchange.read_json(
                self.boundary, partial(detokenize_tokens, limit=checker.max_model_len)
            )
            checker.check_size(tokens)
            ids = checker.tokenize(tokens) if tokens else ()  # checked against the vocabulary
            text = checker.need_tokenizer().decode(list(ids))
        await reply_json(exchange, {"prompt": text})

    async def health(self, request: HttpRequest, exchange: Exchange) -> None:
        with http_errors():
            self.identify(request)
        if self.engine.state is not EngineState.SERVING:
            raise HttpError(503, self.engine.refusal(), code="unavailable")
        await exchange.response.reply(200)

    async def loads(self, request: HttpRequest, exchange: Exchange) -> None:
        with http_errors():
            body = await self.reports.loads(self.viewer(request))
        await exchange.response.reply(200, body)

    async def stats(self, request: HttpRequest, exchange: Exchange) -> None:
        """The engine's figures as the caller may see them: the page's dashboard reads them."""
        with http_errors():
            tenant = self.identify(request)
            name = self.model_name()
            stats = await self.bridge.call(self.engine.stats, None if tenant.admin else tenant.name)
        document = stats_document(stats, name, self.engine.state.value, tenant.admin)
        await exchange.response.reply(200, json.dumps(document).encode(), NOT_STORED)

    async def page_file(self, request: HttpRequest, exchange: Exchange) -> None:
        body, headers = self.page.file(request)
        await exchange.response.reply(200, body, headers)

    async def metrics(self, request: HttpRequest, exchange: Exchange) -> None:
        with http_errors():
            body = await self.reports.metrics(self.viewer(request), self.model_name())
        await exchange.response.reply(200, body, {"Content-Type": PROMETHEUS_TEXT})

    def viewer(self, request: HttpRequest) -> str | None:
        """Whose figures the caller may see: its own, or (None) everyone's, for an admin."""
        tenant = self.identify(request)
        return None if tenant.admin else tenant.name

    async def version(self, request: HttpRequest, exchange: Exchange) -> None:
        with http_errors():
            self.identify(request)
        await reply_json(exchange, {"version": importlib.metadata.version("loom")})


async def reply_json(exchange: Exchange, value: Any) -> None:
    await exchange.response.reply(200, json.dumps(value).encode())
