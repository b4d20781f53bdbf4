"""OpenAI request bodies read field by field into what the engine is asked (`Ask`): the types
checked here, each error naming the field; the values' ranges are the engine's own checks
(SamplingParams, the prompt checks), the same as for a gRPC request.

Taken (chat and completions): model, max_tokens (and chat's max_completion_tokens), n, stream,
stream_options.include_usage, user, and the sampling fields (loom/server/openai/sampling.py);
vLLM's extensions cache_salt, return_tokens_as_token_ids and return_token_ids. Chat: messages
(system, developer, user, assistant; content a string or a list of text parts). Completions:
prompt (a string, strings, token ids, lists of token ids), echo (with logprobs, the prompt's own
log-probabilities too). Refused by name: suffix, best_of, functions and function_call (tools
replace them), non-text parts. Chat's tools and tool_choice: loom/server/openai/tools.py.
Unknown fields are ignored, as OpenAI's and vLLM's servers do.
"""

from __future__ import annotations

from typing import Any

import attrs

from loom.core.prompt import ChatMessage, Prompt
from loom.core.sampling_params import SamplingParams
from loom.core.tenancy import Tenancy
from loom.server.boundary import MAX_CHAT_MESSAGES
from loom.server.openai.errors import invalid
from loom.server.openai.fields import int_list, json_object, optional
from loom.server.openai.sampling import sampling_of
from loom.server.openai.tools import ToolUse, system_message, tool_turn, tool_use_of
from loom.server.relay import EngineRequest

# A constraint of the client's is not composed with the tools' format: with `auto` it would
# decide what the model may write inside a call (a grammar forcing `<tool_call>` and blanks
# was how one request froze the server), with `required` or a function it contradicts theirs.
CONSTRAINED_TOOLS = (
    "response_format and structured_outputs cannot be combined with tools (tool_choice auto, "
    "required or a function constrains the answer to the tools' format); send tool_choice "
    "none, or no response_format"
)
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's: the context)
MAX_USER_CHARS = 256
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
REFUSED = {
    "suffix": "suffix (insertion) is not supported",
    "functions": "functions is replaced by tools",
    "function_call": "function_call is replaced by tool_choice",
}


@attrs.frozen(kw_only=True)
class Ask:
    """What one HTTP request asks of the engine: `n` choices of each prompt."""

    model: str | None
    prompts: tuple[Prompt, ...]
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    cache_salt: str
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N" in logprobs
    token_ids: bool = False  # vLLM's return_token_ids: each choice's token ids beside its text
    tools: ToolUse | None = None  # chat's tools and tool_choice (loom/server/openai/tools.py)

    def submissions(self, tenancy: Tenancy) -> list[EngineRequest]:
        """The engine requests, choice `index` = prompt number * n + i."""
        return [
            choice
            for prompt in self.prompts
            for choice in EngineRequest(
                prompt=prompt, sampling=self.sampling, cache_salt=self.cache_salt, tenancy=tenancy
            ).choices(self.n)
        ]


def chat_ask(body: Any, max_choices: int, reasoning: str | None = None) -> Ask:
    """`reasoning`: the server's --reasoning-parser, after whose thinking a constraint binds."""
    body = json_object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of messages", "messages")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise invalid(f"messages has {len(messages)} items; the limit is {MAX_CHAT_MESSAGES}")
    prompt = [chat_message(m, i) for i, m in enumerate(messages)]
    tools = tool_use_of(body)
    if tools is not None:
        prompt = system_message(tools, prompt)
    max_tokens = optional(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = optional(body, "max_tokens", int)
    top = None
    if optional(body, "logprobs", bool):
        top = optional(body, "top_logprobs", int) or 0
    elif body.get("top_logprobs") is not None:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    asked = ask(body, (prompt,), max_tokens, top, max_choices, echo=False, tools=tools)
    constraint = asked.sampling.constraint
    if reasoning is None or constraint is None:
        return asked
    sampling = attrs.evolve(
        asked.sampling, constraint=attrs.evolve(constraint, reasoning=reasoning)
    )
    return attrs.evolve(asked, sampling=sampling)


def completion_ask(body: Any, max_choices: int, max_ids: int = 1 << 20) -> Ask:
    """`max_ids`: the most token ids a prompt may hold (the context)."""
    body = json_object(body)
    echo = optional(body, "echo", bool) or False
    max_tokens = optional(body, "max_tokens", int)
    top = optional(body, "logprobs", int)
    prompts = completion_prompts(body.get("prompt"), max_ids)
    max_tokens = COMPLETION_MAX_TOKENS if "max_tokens" not in body else max_tokens
    return ask(body, prompts, max_tokens, top, max_choices, echo=echo)


def ask(
    body: dict[str, Any],
    prompts: tuple[Prompt, ...],
    max_tokens: int | None,
    logprobs: int | None,
    max_choices: int,
    *,
    echo: bool,
    tools: ToolUse | None = None,
) -> Ask:
    for field, why in REFUSED.items():
        if body.get(field) not in (None, "", [], {}, "none", "auto"):
            raise invalid(why, field)
    if body.get("best_of") not in (None, 1):
        raise invalid("best_of is not supported: ask for n choices", "best_of")
    n = optional(body, "n", int)
    n = 1 if n is None else n
    if not (1 <= n <= max_choices) or n * len(prompts) > max_choices:
        raise invalid(
            f"n: {n} choices of {len(prompts)} prompts; the limit is "
            f"max_choices={max_choices} in all",
            "n",
        )
    stream = optional(body, "stream", bool) or False
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise invalid("stream_options needs stream set to true", "stream_options")
    user = optional(body, "user", str) or ""
    if len(user) > MAX_USER_CHARS:
        raise invalid(f"user has {len(user)} characters; the limit is {MAX_USER_CHARS}")
    sampling = sampling_of(body, max_tokens, logprobs, echo)
    if tools is not None and sampling.constraint is not None:
        raise invalid(CONSTRAINED_TOOLS, "tool_choice")
    forced = tools.constraint() if tools is not None else None
    if forced is not None:
        sampling = attrs.evolve(sampling, constraint=forced)
    return Ask(
        model=optional(body, "model", str),
        prompts=prompts,
        sampling=sampling,
        n=n,
        stream=stream,
        include_usage=bool(options and optional(options, "include_usage", bool)),
        echo=echo,
        cache_salt=optional(body, "cache_salt", str) or "",
        tokens_as_ids=optional(body, "return_tokens_as_token_ids", bool) or False,
        token_ids=optional(body, "return_token_ids", bool) or False,
        tools=tools,
    )


def chat_message(message: Any, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object with role and content", "messages")
    role = message.get("role")
    if role == "tool" or (role == "assistant" and message.get("tool_calls")):
        return tool_turn(message, where, chat_content(message.get("content") or "", where))
    if role not in ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
    return ChatMessage(role=ROLES[role], content=chat_content(message.get("content"), where))


def chat_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise invalid(f"{where}.content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where}.content must be a string or a list of text parts", "messages")


def completion_prompts(prompt: Any, max_ids: int) -> tuple[Prompt, ...]:
    """A string, a list of strings, a list of token ids, or a list of such lists (each list
    of ids at most `max_ids` long: the context)."""
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int):
            return (int_list(prompt, "prompt", max_ids),)
        if all(isinstance(p, str) for p in prompt):
            return tuple(prompt)
        if all(isinstance(p, list) and p for p in prompt):
            return tuple(int_list(p, "prompt", max_ids) for p in prompt)
    raise invalid(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "non-empty lists of token ids",
        "prompt",
    )


def tokenize_prompt(body: Any) -> Prompt:
    if isinstance(body, dict) and isinstance(body.get("prompt"), str):
        return str(body["prompt"])
    if isinstance(body, dict) and isinstance(body.get("messages"), list):
        return [chat_message(m, i) for i, m in enumerate(body["messages"])]
    raise invalid("tokenize takes prompt (a string) or messages", "prompt")


def detokenize_tokens(body: Any, limit: int) -> list[int]:
    return int_list(body.get("tokens") if isinstance(body, dict) else None, "tokens", limit)


def echoes(tokenizer: Any, prompts: tuple[Prompt, ...]) -> list[str]:
    """Each prompt's text, for `echo`."""
    texts = []
    for prompt in prompts:
        if isinstance(prompt, str):
            texts.append(prompt)
        elif any(isinstance(p, ChatMessage) for p in prompt) or tokenizer is None:
            texts.append("")
        else:
            texts.append(tokenizer.decode(list(prompt)))
    return texts
