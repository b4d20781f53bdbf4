"""Tool calls in the chat API: `tools` and `tool_choice`, rendered into the prompt, generated
under a constraint where the call is forced, and parsed back into OpenAI's `tool_calls`.

    tool_choice "none"      the tools are not shown; a plain answer
                "auto"      the tools are shown (Hermes style: below); the model may answer or
                            write <tool_call>{"name": ..., "arguments": {...}}</tool_call>
                            blocks, parsed at the end (`HermesParser`; none parses: content)
                "required"  constrained to a JSON array of one or more calls (one, with
                            parallel_tool_calls false), each one of the functions with
                            arguments valid against its parameters
                a function  constrained to that function's parameters: the output is the
                            arguments, streamed as they come
    finish_reason "tool_calls" when the answer is calls ("length" if max_tokens cut them)

SmolLM2's chat template does not render tools, so Loom writes them into the system message,
in the Hermes format many small models were tuned on; an earlier assistant turn's calls and
the tool results (`role: "tool"`) are rendered the same way. The parser is the replaceable
piece: another model family's format is another parser.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import attrs

from loom.core.constraint import Constraint, ConstraintKind
from loom.core.prompt import ChatMessage
from loom.server.openai.errors import invalid
from loom.server.openai.structured import schema_text

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}}
SYSTEM = (
    "You are a function calling AI model. You are given function signatures within <tools>"
    "</tools> XML tags. You may call one or more functions to answer the user's query. For "
    "each call, return a JSON object with the function's name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <name>, "arguments": '
    "<arguments object>}\n</tool_call>\nHere are the available tools: <tools>\n"
)
OPEN, CLOSE = "<tool_call>", "</tool_call>"


@attrs.frozen(kw_only=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def shown(self) -> str:
        return json.dumps({"type": "function", "function": attrs.asdict(self)}, ensure_ascii=False)


@attrs.frozen(kw_only=True)
class ToolUse:
    """What a chat request asks of tools: `mode` auto, required or named (`name`)."""

    tools: tuple[Tool, ...]
    mode: str
    name: str = ""
    parallel: bool = True  # parallel_tool_calls: false, at most one call (required: one)

    def constraint(self) -> Constraint | None:
        if self.mode == "named":
            (tool,) = [t for t in self.tools if t.name == self.name]
            return Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps(tool.parameters))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps(schema))

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The answer's content and its calls (OpenAI's objects, with ids)."""
        if self.mode == "named":
            return None, [call(self.name, text)]
        if self.mode == "required":
            try:
                found = json.loads(text)
                return None, [call(c["name"], json.dumps(c["arguments"])) for c in found]
            except (ValueError, RecursionError, TypeError, KeyError):  # cut by max_tokens
                return text, []
        content, calls = HermesParser(names={t.name for t in self.tools}).parse(text)
        return content, calls if self.parallel else calls[:1]


@attrs.frozen(kw_only=True)
class HermesParser:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks; all or nothing: a block
    unclosed (cut by max_tokens), not JSON, not an object, naming no tool of the request or
    with arguments that are not an object leaves the whole answer as content, no calls.

    Linear in the answer's length: the tags are found with `str.find` and each block is read
    by `json.loads`, never by a backtracking pattern (`<tool_call>\\s*(.*?)\\s*</tool_call>`
    took 28 s over 4,000 blanks a client's grammar had forced, on the thread serving both
    fronts). The answer is at most max_tokens long, so the whole parse is bounded too."""

    names: set[str]

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        calls, at = [], text.find(OPEN)
        if at < 0:
            return text, []
        content = text[:at].strip()
        while at >= 0:
            end = text.find(CLOSE, at)
            if end < 0:
                return text, []
            found = self.one(text[at + len(OPEN) : end])
            if found is None:
                return text, []
            calls.append(found)
            at = text.find(OPEN, end)
        return content or None, calls

    def one(self, block: str) -> dict[str, Any] | None:
        """The call a block holds, or None where it holds none."""
        try:
            found = json.loads(block)  # surrounding blanks are JSON's own whitespace
        except (ValueError, RecursionError):
            return None
        if not isinstance(found, dict):
            return None
        name, arguments = found.get("name"), found.get("arguments", {})
        if not isinstance(name, str) or name not in self.names or not isinstance(arguments, dict):
            return None
        try:
            return call(name, json.dumps(arguments))
        except (ValueError, RecursionError):  # as deep as it parsed, it must also write
            return None


def call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def tool_use_of(body: dict[str, Any]) -> ToolUse | None:
    """The request's tools and tool_choice; None when it has none or asks for none."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    found = tuple(tool_of(t, i) for i, t in enumerate(tools))
    if len({t.name for t in found}) != len(found):
        raise invalid("tools: each function needs a name of its own", "tools")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if choice is None or choice == "auto":
        return ToolUse(tools=found, mode="auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolUse(tools=found, mode="required", parallel=parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    named = isinstance(choice, dict) and choice.get("type") == "function"
    if not named or not isinstance(name, str) or name not in {t.name for t in found}:
        raise invalid(
            "tool_choice must be none, auto, required or "
            '{"type": "function", "function": {"name": <one of tools>}}',
            "tool_choice",
        )
    return ToolUse(tools=found, mode="named", name=name)


def tool_of(tool: Any, index: int) -> Tool:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not (
        isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
    ):
        raise invalid(
            f'tools[{index}] must be {{"type": "function", "function": {{...}}}}', "tools"
        )
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(f"tools[{index}].function.name must match {NAME.pattern}", "tools")
    parameters = function.get("parameters", NO_PARAMETERS)
    description = function.get("description", "")
    if not isinstance(parameters, dict) or not isinstance(description, str):
        raise invalid(
            f"tools[{index}].function: parameters must be an object, description a string",
            "tools",
        )
    schema_text(parameters, f"tools[{index}].function.parameters", "tools")
    return Tool(name=name, description=description, parameters=parameters)


def system_message(use: ToolUse, messages: list[ChatMessage]) -> list[ChatMessage]:
    """The tools shown in the system message (the first one's text kept after them)."""
    shown = SYSTEM + "\n".join(t.shown() for t in use.tools) + "\n</tools>"
    if messages and messages[0].role == "system":
        first = ChatMessage(role="system", content=f"{messages[0].content}\n\n{shown}")
        return [first, *messages[1:]]
    return [ChatMessage(role="system", content=shown), *messages]


def tool_turn(message: dict[str, Any], where: str, content: str) -> ChatMessage:
    """An earlier assistant turn's calls, or a tool's result, as the Hermes format has them."""
    if message.get("role") == "tool":
        return ChatMessage(role="user", content=f"<tool_response>\n{content}\n</tool_response>")
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls must be a list", "messages")
    blocks = []
    for item in calls:
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
            raise invalid(f"{where}.tool_calls: each needs function name and arguments", "messages")
        try:  # the arguments as an object, as the model writes them
            arguments = json.loads(function["arguments"])
            json.dumps(arguments)  # as deep as it parsed, it must also write
        except (ValueError, RecursionError):
            arguments = function["arguments"]
        shown = {"name": function.get("name"), "arguments": arguments}
        blocks.append(f"<tool_call>\n{json.dumps(shown, ensure_ascii=False)}\n</tool_call>")
    return ChatMessage(role="assistant", content="\n".join([content, *blocks]).strip())
