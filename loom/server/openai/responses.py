"""OpenAI's response objects, framed for the relay (loom/server/relay.py `Framing`).

Streaming (`text/event-stream`): each message is one or more `data: {json}\\n\\n` events of
chunk objects sharing one `id`, `created` and `model`. A choice's first chunk carries the role
(chat), then content as it comes; its last content chunk carries `finish_reason`; once every
choice has finished, a usage chunk with empty `choices` (with `stream_options.include_usage`,
every other chunk then has `"usage": null`), then `data: [DONE]`. An end that is not a finish
after something was sent is an `error` event, then `[DONE]`.

Whole: nothing is sent until every choice has finished; then one JSON object, the same content
assembled. Usage counts each prompt once, however many choices it has.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from loom.core.request_output import Logprobs, RequestOutput
from loom.server.boundary import MAX_WHOLE_LOGPROBS
from loom.server.openai.choice import Choice, Prompt
from loom.server.openai.errors import StreamEndedError, finish_error, invalid
from loom.server.openai.json_body import Whole
from loom.server.openai.reasoning import Reasoning
from loom.server.openai.requests import Ask
from loom.server.openai.tokens import TokenTexts

DONE = b"data: [DONE]\n\n"
# Log-probabilities a whole response may hold (tokens x (top + 1), prompt's included): it is
# built at once, on the loop both fronts share, and rendered in slices off it (1.7 MB of JSON).


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class OpenAIFraming:
    """Chat completions or completions, streamed or whole; `echoes[i]` is prompt i's text for
    `echo`."""

    def __init__(
        self,
        ask: Ask,
        *,
        chat: bool,
        request_id: str,
        model: str,
        tokens: TokenTexts,
        echoes: Sequence[str] = (),
        reasoning: str | None = None,
    ) -> None:
        self.ask = ask
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.model = model
        self.tokens = tokens
        self.echoes = echoes
        self.choices = [Choice() for _ in range(len(ask.prompts) * ask.n)]
        # chat's reasoning split from each choice's answer (loom/server/openai/reasoning.py);
        # a constraint binds the answer after the thinking (loom/core/constraint.py)
        self.reasoning = (
            [Reasoning(reasoning) for _ in self.choices] if chat and reasoning else None
        )
        self.began: set[int] = set()  # choices whose first chunk has gone
        self.kept = 0  # log-probabilities held for a whole response
        top, max_tokens = ask.sampling.logprobs, ask.sampling.max_tokens
        if not ask.stream and top is not None and max_tokens is not None:
            self.keep(len(self.choices) * max_tokens * (top + 1))
        self.sent = False  # anything framed for the client (a stream's error comes as an event)

    # The relay's calls

    def delta(self, index: int, batch: Sequence[RequestOutput]) -> bytes | None:
        self.keep(self.choices[index].add(batch, keep=not self.ask.stream))
        said = self.said(index, batch, last=False)
        if not self.ask.stream:
            return None
        return self.chunks(index, batch, None, said)

    def final(self, index: int, batch: Sequence[RequestOutput], done: bool) -> bytes | Whole | None:
        choice = self.choices[index]
        self.keep(choice.add(batch, keep=not self.ask.stream))
        said = self.said(index, batch, last=True)
        if not self.ask.stream:  # rendered off the I/O thread as it is sent (json_body.Whole)
            return Whole(self.whole()) if done else None
        message = self.chunks(index, batch, choice.finish_reason, said)
        if done:
            if self.ask.include_usage:
                message += event(self.chunk([], usage=self.usage()))
            message += DONE
        return message

    def said(self, index: int, batch: Sequence[RequestOutput], last: bool) -> dict[str, str]:
        """A chat delta's text: its content, or (with a reasoning parser) its reasoning_content
        and content, either left out when it adds nothing."""
        if self.reasoning is None:
            return {"content": "".join(o.text for o in batch)}
        split, thought, answer = self.reasoning[index], "", ""
        for at, output in enumerate(batch):  # a step at a time, so its tokens count as it goes
            pieces = split.feed(output.text, len(output.token_ids), last and at == len(batch) - 1)
            thought, answer = thought + pieces[0], answer + pieces[1]
        said = {"reasoning_content": thought} if thought else {}
        return said | ({"content": answer} if answer or not thought else {})

    def keep(self, count: int) -> None:
        """Hold `count` more log-probabilities for a whole response, within the limit."""
        self.kept += count
        if self.kept > MAX_WHOLE_LOGPROBS:
            raise invalid(
                f"logprobs: a whole response holds at most {MAX_WHOLE_LOGPROBS} "
                "log-probabilities (tokens x (top + 1), every choice's); ask for fewer, or "
                "stream it",
                "logprobs",
            )

    def abnormal(self, index: int, batch: Sequence[RequestOutput]) -> tuple[Any, Exception]:
        error = finish_error(batch[-1])
        if not self.ask.stream or not self.sent:
            return None, error
        partial = b""
        if len(batch) > 1:  # what came before the end, split as the stream splits it
            said = self.said(index, batch[:-1], last=True)
            partial = self.chunks(index, batch[:-1], None, said)
        return partial + event(error.body()) + DONE, StreamEndedError(error)

    # Chunks

    def chunks(
        self,
        index: int,
        batch: Sequence[RequestOutput],
        finish: str | None,
        said: dict[str, str] | None = None,
    ) -> bytes:
        self.sent = True
        text = "".join(o.text for o in batch)
        logprobs = [lp for o in batch for lp in o.logprobs]
        first, prompt = b"", None
        if index not in self.began:
            self.began.add(index)
            echo = self.echo_of(index)
            if self.chat:
                role = self.piece(index, {"role": "assistant", "content": ""})
                role["logprobs"] = None
                first = event(self.chunk([role]))
            elif self.ask.echo:
                text = echo + text
                prompt = self.choices[index].prompt
        said = {"content": text} if said is None else said
        quiet = said == {"content": ""} and finish is None and not logprobs
        if self.chat and quiet and not self.ask.token_ids:
            return first  # nothing to say yet (a marker held back)
        piece = self.piece(index, said if self.chat else text, finish, logprobs, prompt)
        if self.ask.token_ids:
            piece["token_ids"] = [t for o in batch for t in o.token_ids]
        return first + event(self.chunk([piece]))

    def chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": f"{self.object}.chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.ask.include_usage:
            chunk["usage"] = usage
        return chunk

    def piece(
        self,
        index: int,
        content: Any,
        finish: str | None = None,
        logprobs: Sequence[Logprobs] = (),
        prompt: Prompt | None = None,
    ) -> dict[str, Any]:
        piece: dict[str, Any] = {"index": index}
        piece["delta" if self.chat else "text"] = content
        if self.ask.sampling.logprobs is None:
            piece["logprobs"] = None
        else:
            choice = self.choices[index]
            piece["logprobs"] = self.logprobs_of(logprobs, prompt, choice.offset)
            if not self.chat:
                choice.offset += sum(len(t) for t in piece["logprobs"]["tokens"])
        piece["finish_reason"] = finish
        return piece

    # Whole responses

    def whole(self) -> dict[str, Any]:
        choices = []
        for index, choice in enumerate(self.choices):
            text = self.echo_of(index) + "".join(choice.text)
            item: dict[str, Any] = {"index": index}
            if self.chat and self.reasoning is not None:
                split = self.reasoning[index]
                item["message"] = {
                    "role": "assistant",
                    "content": split.content,
                    "reasoning_content": split.reasoning,
                }
            elif self.chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = text
            with_logprobs = self.ask.sampling.logprobs is not None
            prompt = choice.prompt if self.ask.echo else None
            item["logprobs"] = self.logprobs_of(choice.logprobs, prompt) if with_logprobs else None
            item["finish_reason"] = choice.finish_reason
            if self.ask.token_ids:
                item["token_ids"] = choice.token_ids
            choices.append(item)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

    def usage(self) -> dict[str, Any]:
        """Each prompt once (from its first choice), every choice's completion tokens."""
        prompt = cached = 0
        for index in range(0, len(self.choices), self.ask.n):
            counted = self.choices[index].usage
            prompt += counted.prompt_tokens if counted else 0
            cached += counted.cached_tokens if counted else 0
        completion = sum(c.num_tokens for c in self.choices)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if self.reasoning is not None:
            reasoning_tokens = sum(r.tokens for r in self.reasoning)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage

    def echo_of(self, index: int) -> str:
        return self.echoes[index // self.ask.n] if self.ask.echo and self.echoes else ""

    def logprobs_of(
        self, logprobs: Sequence[Logprobs], prompt: Prompt | None = None, start: int = 0
    ) -> dict[str, Any]:
        """Chat's `content` list, or completions' parallel lists (`text_offset` from `start`,
        the characters the choice's earlier chunks held); with `prompt` (echo), the prompt's
        tokens first, its first token's logprob null (nothing comes before it)."""
        if self.chat:
            return {"content": [self.chat_logprob(lp) for lp in logprobs]}
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if prompt is not None and prompt[0]:
            tokens.append(self.tokens.text(prompt[0][0]))
            values.append(None)
            tops.append(None)
            logprobs = [*prompt[1], *logprobs]
        for lp in logprobs:
            tokens.append(self.tokens.text(lp.chosen.token_id))
            values.append(lp.chosen.logprob)
            tops.append({self.tokens.text(t.token_id): t.logprob for t in lp.top})
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets(tokens, start),
        }

    def chat_logprob(self, logprobs: Logprobs) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.tokens.text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(self.tokens.bytes(token_id))}

        chosen = item(logprobs.chosen.token_id, logprobs.chosen.logprob)
        chosen["top_logprobs"] = [item(t.token_id, t.logprob) for t in logprobs.top]
        return chosen


def offsets(tokens: Sequence[str], start: int = 0) -> list[int]:
    """Each token's character offset in the text they make (it starting at `start`)."""
    result, at = [], start
    for token in tokens:
        result.append(at)
        at += len(token)
    return result
