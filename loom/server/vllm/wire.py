"""Conversions between vllm.grpc.engine's messages (loom/smg/, as the SMG gateway sends them)
and the engine's types, with vLLM's meanings for the fields a proto3 message cannot leave
unset: `top_p` 0, `top_k` 0 and `repetition_penalty` 0 mean "off", `n` 0 means 1, `temperature`,
`max_tokens`, `seed` and `logprobs` are taken only when set. What Loom cannot do is refused with
INVALID_ARGUMENT naming the field: images, a prefill/decode handoff, prompt
truncation, structural tags, all logprobs (-1). What shapes text alone is not read, as Loom
sends token ids (the gateway decodes them): `skip_special_tokens` (Loom's stop strings are
matched on text without special tokens), `spaces_between_special_tokens`,
`include_stop_str_in_output`; and `grammar_from_first_token` (a grammar always starts at the
first token: there is no reasoning parser to wait for)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from loom.core.errors import InvalidRequestError
from loom.core.prompt import Prompt
from loom.core.request_output import FinishReason, Logprobs, RequestOutput
from loom.core.sampling_params import SamplingParams, logit_bias_pairs
from loom.engine.stats import EngineStats, ModelInfo
from loom.server.grpc.wire import constraint_from
from loom.server.load import Load
from loom.smg import vllm_engine_pb2 as pb

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.LENGTH: "length",
}
SEED_RANGE = 1 << 32  # a negative int32 seed is taken modulo this


def prompt_from(request: pb.GenerateRequest) -> Prompt:
    """Token ids (the gateway tokenized and templated them), or text for Loom to tokenize."""
    for field in ("mm_inputs", "media_refs", "kv_transfer_params"):
        if request.HasField(field):
            raise InvalidRequestError(f"{field} is not supported: a text model, no handoff")
    if request.extra_mm_inputs:
        raise InvalidRequestError("extra_mm_inputs is not supported: a text model")
    if request.HasField("kv_transfer_params_json"):
        raise InvalidRequestError("kv_transfer_params_json is not supported: no handoff")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidRequestError(
            f"data_parallel_rank must be 0 (one rank), got {request.data_parallel_rank}"
        )
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        return request.tokenized.input_ids  # not copied: the engine counts them first
    if kind == "text":
        return request.text
    raise InvalidRequestError("input is required: set tokenized or text")


def embed_prompt(request: pb.EmbedRequest) -> Prompt:
    """An Embed call's token ids (its original text, for Loom to tokenize, if it sent none)."""
    if request.tokenized.input_ids:
        return request.tokenized.input_ids
    if request.tokenized.original_text:
        return request.tokenized.original_text
    raise InvalidRequestError("tokenized is required: input_ids or original_text")


def sampling_from(message: pb.SamplingParams) -> SamplingParams:
    """vLLM's meanings (the module's docstring); validation names the field."""
    for field in ("truncate_prompt_tokens", "structural_tag"):
        if message.HasField(field):
            raise InvalidRequestError(f"{field} is not supported")
    if message.HasField("logprobs") and message.logprobs < 0:
        raise InvalidRequestError("logprobs: -1 (every token's) is not supported; ask 0..20")
    optional = {
        field: getattr(message, field)
        for field in ("temperature", "max_tokens", "logprobs", "prompt_logprobs")
        if message.HasField(field)
    }
    return SamplingParams(
        **optional,
        top_p=message.top_p or 1.0,
        top_k=message.top_k,
        min_p=message.min_p,
        repetition_penalty=message.repetition_penalty or 1.0,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        seed=message.seed % SEED_RANGE if message.HasField("seed") else None,
        min_tokens=message.min_tokens,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logit_bias=logit_bias_pairs(message.logit_bias),
        constraint=constraint_from(message),
    )


def num_choices(message: pb.SamplingParams, max_choices: int) -> int:
    n = message.n or 1
    if n > max_choices:
        raise InvalidRequestError(f"n is {n}; the limit is max_choices={max_choices}")
    return n


def output_logprobs(outputs: Sequence[RequestOutput]) -> pb.OutputLogProbs | None:
    chosen = [lp for o in outputs for lp in o.logprobs]
    if not chosen:
        return None
    return pb.OutputLogProbs(
        token_logprobs=[lp.chosen.logprob for lp in chosen],
        token_ids=[lp.chosen.token_id for lp in chosen],
        top_logprobs=[top_of(lp) for lp in chosen],
    )


def input_logprobs(outputs: Sequence[RequestOutput]) -> pb.InputLogProbs | None:
    """The prompt's logprobs, which come with a request's first token: the first prompt token
    has none."""
    first = next((o for o in outputs if o.prompt_token_ids), None)
    if first is None:
        return None
    return pb.InputLogProbs(
        token_logprobs=[
            pb.InputTokenLogProb(),
            *(pb.InputTokenLogProb(value=lp.chosen.logprob) for lp in first.prompt_logprobs),
        ],
        token_ids=first.prompt_token_ids,
        top_logprobs=[pb.TopLogProbs(), *(top_of(lp) for lp in first.prompt_logprobs)],
    )


def top_of(logprobs: Logprobs) -> pb.TopLogProbs:
    return pb.TopLogProbs(
        values=[t.logprob for t in logprobs.top], token_ids=[t.token_id for t in logprobs.top]
    )


def matched_stop(last: RequestOutput) -> dict[str, int | str]:
    """GenerateComplete's `matched_stop`: the stop token id or stop string that ended it."""
    reason = last.stop_reason
    if reason is None:
        return {}
    return {"matched_stop_str": reason} if isinstance(reason, str) else {"matched_token_id": reason}


def model_info_message(info: ModelInfo, served_model_name: str | None) -> pb.GetModelInfoResponse:
    """No tokenizer path: the gateway takes the tokenizer from GetTokenizer, whatever its
    machine has (a path of this one's would mean nothing there)."""
    return pb.GetModelInfoResponse(
        model_path=info.model,
        is_generation=info.is_generation,
        max_context_length=info.max_model_len,
        vocab_size=info.vocab_size,
        served_model_name=served_model_name or info.model,
        model_type=info.architecture,
        architectures=[info.architecture] if info.architecture else [],
        eos_token_ids=info.eos_token_ids,
        pad_token_id=info.pad_token_id or 0,
        bos_token_id=info.bos_token_id or 0,
        max_req_input_len=info.max_model_len - 1,  # room for one token out
    )


def server_info_message(
    info: ModelInfo, stats: EngineStats, uptime: float
) -> pb.GetServerInfoResponse:
    return pb.GetServerInfoResponse(
        active_requests=stats.num_running + stats.num_waiting,
        uptime_seconds=uptime,
        server_type="loom",
        data_parallel_size=1,
        kv_cache_dtype="auto",
        block_size=info.block_size,
        model_dtype=f"torch.{info.dtype}",
        max_num_seqs=info.max_num_seqs,
        constrained_decoding_start="first_token",  # no reasoning parser holds a grammar back
    )


def scheduler_load(load: Load) -> pb.SchedulerLoad:
    return pb.SchedulerLoad(dp_rank=0, **attrs.asdict(load))
