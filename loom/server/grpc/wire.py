"""Conversions between the loom.v1 protobuf messages and the engine's types.

EngineStats and ModelInfo name their fields as ServerStats and ModelInfo do, so they convert
by name."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import attrs

from loom.core.constraint import Constraint, ConstraintKind
from loom.core.errors import InvalidRequestError
from loom.core.prompt import ChatMessage, Prompt
from loom.core.request_output import FinishReason, Logprobs, RequestOutput
from loom.core.sampling_params import SamplingParams, logit_bias_pairs
from loom.core.tenancy import MAX_PRIORITY, Tenancy
from loom.engine.stats import EngineStats, ModelInfo, TenantStats
from loom.server.boundary import MAX_CHAT_MESSAGES, MAX_REQUEST_ID_CHARS
from loom.v1 import loom_pb2 as pb

FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
}
OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "logprobs",
)


def request_id_from(request: Any) -> str:
    """The client's label for its request (one the server makes, when empty): loom.v1's
    GenerateRequest's, or vllm.grpc.engine's."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            f"request_id has {len(request.request_id)} characters; "
            f"the limit is {MAX_REQUEST_ID_CHARS}"
        )
    return request.request_id or uuid.uuid4().hex


def prompt_from(request: pb.GenerateRequest) -> Prompt:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text
    if kind == "messages":
        messages = request.messages.messages
        if len(messages) > MAX_CHAT_MESSAGES:  # before making an object of each
            raise InvalidRequestError(
                f"messages has {len(messages)} items; the limit is {MAX_CHAT_MESSAGES}"
            )
        return [ChatMessage(role=m.role, content=m.content) for m in messages]
    if kind == "token_ids":
        return request.token_ids.ids  # not copied: the engine counts them first
    raise InvalidRequestError("prompt is required: set text, messages or token_ids")


def sampling_from(message: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep the engine's defaults; validation names the field."""
    given = {f: getattr(message, f) for f in OPTIONAL_SAMPLING_FIELDS if message.HasField(f)}
    return SamplingParams(
        **given,
        min_tokens=message.min_tokens,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logit_bias=logit_bias_pairs(message.logit_bias),
        constraint=constraint_from(message),
        speculative=message.speculative if message.HasField("speculative") else True,
    )


def constraint_from(message: Any) -> Constraint | None:
    """The `constraint` oneof of loom.v1's SamplingParams, or vllm.grpc.engine's (the same
    names; its `structural_tag` is refused before)."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return Constraint(kind=ConstraintKind.CHOICE, choices=tuple(message.choice.choices))
    if kind == "json_object":
        if not message.json_object:
            raise InvalidRequestError("json_object must be true when set")
        return Constraint(kind=ConstraintKind.JSON_OBJECT)
    return Constraint(kind=ConstraintKind(kind), spec=getattr(message, kind))


def delta_from(outputs: Sequence[RequestOutput]) -> pb.Delta:
    """One Delta for several outputs in a row (a slow reader gets them merged)."""
    return pb.Delta(
        token_ids=[t for o in outputs for t in o.token_ids],
        text="".join(o.text for o in outputs),
        logprobs=[logprobs_message(lp) for o in outputs for lp in o.logprobs],
    )


def logprobs_message(logprobs: Logprobs) -> pb.Logprobs:
    return pb.Logprobs(
        chosen=pb.TokenLogprob(token_id=logprobs.chosen.token_id, logprob=logprobs.chosen.logprob),
        top=[pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in logprobs.top],
    )


def final_from(outputs: Sequence[RequestOutput], request_id: str) -> pb.Final:
    """The Final message for a normal finish; `outputs[-1]` is the finished one. `request_id`
    is the client's (or the one the server made for it), not the engine's."""
    last = outputs[-1]
    if last.finish_reason not in FINISH_REASONS or last.usage is None or last.timings is None:
        raise ValueError(f"not a normal finish: {last.finish_reason}")
    return pb.Final(
        request_id=request_id,
        delta=delta_from(outputs),
        finish_reason=FINISH_REASONS[last.finish_reason],
        usage=pb.Usage(
            prompt_tokens=last.usage.prompt_tokens,
            completion_tokens=last.usage.completion_tokens,
            cached_tokens=last.usage.cached_tokens,
        ),
        timings=pb.Timings(
            queue_ms=last.timings.queue_ms,
            ttft_ms=last.timings.ttft_ms or 0.0,
            e2e_ms=last.timings.e2e_ms,
        ),
    )


def stats_message(stats: EngineStats) -> pb.ServerStats:
    """The engine's stats as its viewer may see them (Engine.stats: the server's gauges, and
    the viewer's own token and cache figures, or everyone's for an admin)."""
    fields = attrs.asdict(stats, recurse=False)
    tenants = fields.pop("tenants")
    spec = fields.pop("spec_decode")
    message = pb.ServerStats(**fields)
    if spec is not None:
        message.spec_decode.CopyFrom(pb.SpecDecodeStats(**attrs.asdict(spec)))
    for name, figures in tenants.items():
        message.tenants[name].CopyFrom(tenant_message(figures))
    return message


def tenant_message(figures: TenantStats) -> pb.TenantStats:
    return pb.TenantStats(**attrs.asdict(figures))


def tenancy_from(
    request: pb.GenerateRequest, tenant: str, weight: float, connection: str
) -> Tenancy:
    if not (-MAX_PRIORITY <= request.priority <= MAX_PRIORITY):
        raise InvalidRequestError(
            f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {request.priority}"
        )
    return Tenancy(tenant=tenant, weight=weight, priority=request.priority, connection=connection)


def model_info_message(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(**attrs.asdict(info))
