"""How a vllm.grpc.engine Generate stream frames each choice's outputs (loom/server/relay.py's
`Framing`), as vLLM's own servicer does and the SMG gateway reads them:

    streamed: a GenerateStreamChunk per batch of new tokens (`completion_tokens` that batch's
        count: the gateway adds them up), and at the choice's end its last chunk, then a
        GenerateComplete carrying that last batch again, the finish reason and the totals
    whole: nothing until the choice ends, then one GenerateComplete with all its tokens

Choices are told apart by `index`. The prompt's logprobs, when asked, come on the first chunk
(or the Complete). Any end but a normal finish is the gRPC status for it (the same as
loom.v1's), after a chunk of the tokens not yet sent when streaming. An Embed call's answer
(`EmbedFraming`) is one EmbedResponse: the vector, its length and the prompt's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpclib import GRPCError

from loom.core.errors import InvalidRequestError
from loom.core.request_output import RequestOutput
from loom.server.boundary import MAX_WHOLE_LOGPROBS
from loom.server.grpc.status import ABNORMAL_STATUS
from loom.server.vllm import wire
from loom.smg import vllm_engine_pb2 as pb


class VllmFraming:
    def __init__(self, *, stream: bool, num_choices: int, num_prompt_tokens: int) -> None:
        self.stream = stream
        self.num_prompt_tokens = num_prompt_tokens  # 0 until known, for a text prompt
        self.held: list[list[RequestOutput]] = [[] for _ in range(num_choices)]  # whole: all
        self.kept = 0  # log-probabilities held, every choice's

    def delta(self, index: int, batch: Sequence[RequestOutput]) -> Any:
        if not self.stream:
            self.keep(batch)
            self.held[index].extend(batch)
            return None
        return pb.GenerateResponse(chunk=self.chunk(index, batch))

    def final(self, index: int, batch: Sequence[RequestOutput], done: bool) -> Any:
        last = batch[-1]
        if not self.stream:
            self.keep(batch)
            outputs = [*self.held[index], *batch]
            self.held[index] = []
            return pb.GenerateResponse(complete=self.complete(index, outputs, last))
        chunk = pb.GenerateResponse(chunk=self.chunk(index, batch))
        return chunk, pb.GenerateResponse(complete=self.complete(index, batch, last))

    def keep(self, batch: Sequence[RequestOutput]) -> None:
        """Hold a whole answer's log-probabilities within MAX_WHOLE_LOGPROBS."""
        self.kept += sum(1 + len(lp.top) for o in batch for lp in o.logprobs)
        if self.kept > MAX_WHOLE_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs: a whole answer holds at most {MAX_WHOLE_LOGPROBS} log-probabilities "
                "(tokens x (logprobs + 1), every choice's); ask for fewer, or stream it"
            )

    def abnormal(self, index: int, batch: Sequence[RequestOutput]) -> tuple[Any, Exception]:
        last = batch[-1]
        sent = self.stream and (len(batch) > 1 or last.token_ids)
        partial = self.delta(index, batch) if sent else None
        status = ABNORMAL_STATUS[last.finish_reason]  # type: ignore[index]
        return partial, GRPCError(status, last.error or str(last.finish_reason))

    def chunk(self, index: int, batch: Sequence[RequestOutput]) -> pb.GenerateStreamChunk:
        usage = batch[-1].usage
        token_ids = [t for o in batch for t in o.token_ids]
        return pb.GenerateStreamChunk(
            token_ids=token_ids,
            prompt_tokens=usage.prompt_tokens if usage else self.num_prompt_tokens,
            completion_tokens=len(token_ids),
            cached_tokens=usage.cached_tokens if usage else 0,
            output_logprobs=wire.output_logprobs(batch),
            input_logprobs=wire.input_logprobs(batch),
            index=index,
        )

    def complete(
        self, index: int, outputs: Sequence[RequestOutput], last: RequestOutput
    ) -> pb.GenerateComplete:
        usage = last.usage
        if last.finish_reason not in wire.FINISH_REASONS or usage is None:
            raise ValueError(f"not a normal finish: {last.finish_reason}")
        output_ids = [t for o in outputs for t in o.token_ids]
        return pb.GenerateComplete(
            output_ids=output_ids,
            finish_reason=wire.FINISH_REASONS[last.finish_reason],
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=len(output_ids),
            cached_tokens=usage.cached_tokens,
            spec_draft_tokens=usage.draft_tokens,
            spec_accepted_tokens=usage.accepted_draft_tokens,
            output_logprobs=wire.output_logprobs(outputs),
            input_logprobs=None if self.stream else wire.input_logprobs(outputs),
            index=index,
            **wire.matched_stop(last),  # type: ignore[arg-type]
        )


class EmbedFraming:
    """An Embed call's one answer: the vector, once its prompt is pooled (loom/core/pooling.py);
    any other end is the gRPC status for it."""

    def delta(self, index: int, batch: Sequence[RequestOutput]) -> Any:
        return None  # an embedding says nothing before its end

    def final(self, index: int, batch: Sequence[RequestOutput], done: bool) -> Any:
        last = batch[-1]
        vector = last.embedding or ()
        prompt_tokens = last.usage.prompt_tokens if last.usage is not None else 0
        return pb.EmbedResponse(
            embedding=vector, prompt_tokens=prompt_tokens, embedding_dim=len(vector)
        )

    def abnormal(self, index: int, batch: Sequence[RequestOutput]) -> tuple[Any, Exception]:
        last = batch[-1]
        status = ABNORMAL_STATUS[last.finish_reason]  # type: ignore[index]
        return None, GRPCError(status, last.error or str(last.finish_reason))
