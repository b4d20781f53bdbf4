"""OpenAI's Responses API request (`POST /v1/responses`) read as the chat request it amounts to,
so that one path (loom/server/openai/requests.py) checks it and the engine serves it alike.

Taken: `input` (a string, or a list of items: messages with role user, system, developer or
assistant and content a string or `input_text` / `output_text` parts; a `function_call` and its
`function_call_output`, which become the chat's assistant tool call and tool result),
`instructions` (a system message before them), `max_output_tokens`, `text.format` (text,
json_object, or json_schema with its `name`, `schema` and `strict`), `tools` (function tools:
`{"type": "function", "name", "description", "parameters"}`), `tool_choice` (none, auto,
required or `{"type": "function", "name"}`), `parallel_tool_calls`, `stream`, `model`, `user`,
`metadata` (echoed), and the sampling fields chat takes (temperature, top_p, seed, logit_bias,
vLLM's extensions). Loom keeps no responses: `store` true, `previous_response_id`,
`conversation` and `background` true are refused with a 400 naming the field, as are items,
parts and tools of other types, and logprobs (`top_logprobs`, `include`'s
message.output_text.logprobs). Errors name the Responses field (`input`, `text.format`).
"""

from __future__ import annotations

from typing import Any

import attrs

from loom.core.errors import InvalidRequestError
from loom.server.boundary import MAX_CHAT_MESSAGES
from loom.server.openai.errors import HttpError, invalid
from loom.server.openai.fields import json_object
from loom.server.openai.requests import Ask, chat_ask

# The fields a Responses body shares with a chat body, taken as chat takes them.
SHARED = (
    "model", "stream", "user", "temperature", "top_p", "seed", "logit_bias", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos",
    "stop", "stop_token_ids", "cache_salt", "speculative", "parallel_tool_calls",
)  # fmt: skip
STATEFUL = {  # what a server that keeps responses offers, with the value that asks for none
    "store": (None, False),
    "previous_response_id": (None,),
    "conversation": (None,),
    "background": (None, False),
}
LOGPROBS = "message.output_text.logprobs"
ROLES = ("user", "system", "developer", "assistant")
RENAMED = {  # chat's fields (and the engine's prompt) as the Responses API names them
    "messages": "input",
    "prompt": "input",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
}
METADATA = (16, 64, 512)  # OpenAI's: at most 16 pairs, keys of 64 characters, values of 512


@attrs.frozen(kw_only=True)
class ResponsesAsk(Ask):
    """A chat Ask, with what the Response object echoes of the request (`settings`)."""

    settings: dict[str, Any]


def responses_ask(body: Any, max_choices: int, reasoning: str | None = None) -> ResponsesAsk:
    body = json_object(body)
    for field, stateless in STATEFUL.items():
        if body.get(field) not in stateless:
            raise invalid(f"{field}: Loom keeps no responses (send none, or store false)", field)
    if body.get("top_logprobs") is not None:
        raise invalid("top_logprobs: logprobs are not served on /v1/responses", "top_logprobs")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or LOGPROBS in include):
        raise invalid(f"include: a list, without {LOGPROBS} (not served here)", "include")
    chat = {field: body[field] for field in SHARED if field in body}
    chat["messages"] = messages_of(body.get("input"), body.get("instructions"))
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    chat["response_format"] = format_of(body.get("text"))
    chat["tools"] = [tool_of(t, i) for i, t in enumerate(listed(body.get("tools"), "tools"))]
    chat["tool_choice"] = tool_choice_of(body.get("tool_choice"))
    try:
        ask = chat_ask(chat, max_choices=1, reasoning=reasoning)
    except (HttpError, InvalidRequestError) as exc:  # named as the Responses API names it
        raise renamed(exc if isinstance(exc, HttpError) else invalid(str(exc))) from None
    metadata = metadata_of(body.get("metadata"))
    settings = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": ask.sampling.temperature,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": ask.sampling.top_p,
        "user": body.get("user"),
    }
    return ResponsesAsk(**attrs.asdict(ask, recurse=False), settings=settings)


def renamed(error: HttpError) -> HttpError:
    """A chat field's error as the Responses API names the field, in its param and message."""
    param = RENAMED.get(error.param or "")
    if param is None:
        return error
    message = error.message.replace(error.param or "", param, 1)
    return HttpError(error.status, message, param=param, code=error.code)


def metadata_of(metadata: Any) -> dict[str, str]:
    pairs, key_chars, value_chars = METADATA
    if metadata is None:
        return {}
    if not (
        isinstance(metadata, dict)
        and len(metadata) <= pairs
        and all(isinstance(v, str) and len(k) <= key_chars and len(v) <= value_chars
                for k, v in metadata.items())
    ):  # fmt: skip
        raise invalid(
            f"metadata must be at most {pairs} strings, keys of at most {key_chars} characters, "
            f"values of at most {value_chars}",
            "metadata",
        )
    return metadata


def listed(value: Any, field: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_CHAT_MESSAGES:
        raise invalid(f"{field} must be a list of at most {MAX_CHAT_MESSAGES} items", field)
    return value


def messages_of(given: Any, instructions: Any) -> list[dict[str, Any]]:
    """The chat messages: the instructions as a system message, then the input's items."""
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions must be a string", "instructions")
    first = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(given, str):
        return [*first, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise invalid("input must be a string or a non-empty list of items", "input")
    return [*first, *(message_of(item, i) for i, item in enumerate(listed(given, "input")))]


def message_of(item: Any, index: int) -> dict[str, Any]:
    """An input item as a chat message, checked here so that errors name the item's place."""
    where = f"input[{index}]"
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "message":
        if item.get("role") not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(ROLES)}", "input")
        return {"role": item["role"], "content": content_of(item.get("content"), where)}
    if kind == "function_call":
        strings(item, where, "call_id", "name", "arguments")
        call = {"name": item["name"], "arguments": item["arguments"]}
        tool_call = {"id": item["call_id"], "type": "function", "function": call}
        return {"role": "assistant", "content": "", "tool_calls": [tool_call]}
    if kind == "function_call_output":
        strings(item, where, "call_id", "output")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    raise invalid(
        f"{where}: items are messages, function_call and function_call_output, got {kind!r}",
        "input",
    )


def strings(item: dict[str, Any], where: str, *fields: str) -> None:
    for field in fields:
        if not isinstance(item.get(field), str):
            raise invalid(f"{where}.{field} must be a string", "input")


def content_of(content: Any, where: str) -> Any:
    """A message's content as chat's: a string, or its text parts as chat's text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of text parts", "input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise invalid(f"{where}.content: only text parts are served, got {kind!r}", "input")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def format_of(text: Any) -> Any:
    """`text.format` as chat's response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else "?"
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object")):
        return fmt
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema must be an object (a JSON schema)", "text.format")
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise invalid(
        "text.format must be an object of type text, json_object or json_schema", "text.format"
    )


def tool_of(tool: Any, index: int) -> dict[str, Any]:
    """A function tool as chat's."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise invalid(f"tools[{index}]: only function tools are served, got {kind!r}", "tools")
    if not isinstance(tool.get("name"), str):
        raise invalid(f"tools[{index}].name must be a string", "tools")
    fields = ("name", "description", "parameters")
    function = {k: tool[k] for k in fields if tool.get(k) is not None}  # null: as left out
    return {"type": "function", "function": function}


def tool_choice_of(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice in (None, "none", "auto", "required"):
        return choice
    raise invalid(
        'tool_choice must be none, auto, required or {"type": "function", "name": <a tool>}',
        "tool_choice",
    )
