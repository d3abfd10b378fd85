"""Tool calling as structured output: with `tool_choice` "required" or a named function, the reply is
constrained to a call, and read back into OpenAI's `tool_calls`.

A named function constrains the reply to its `parameters` schema (the arguments themselves);
"required" to `{"name": <one of the tools>, "arguments": <its parameters>}` (an anyOf over the
tools). `tool_choice` "none" leaves the reply free, as OpenAI does. "auto" would need the model's own
tool-call syntax parsed out of free text: refused, as is a request with tools and no tool_choice
(whose default is "auto").
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from blink_appliance.frontend.errors import bad_request

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolMode:
    """How a reply becomes a tool call: the schema it is constrained to, and the function's name
    when tool_choice named it (else the reply names it)."""

    schema: dict[str, Any]
    name: str | None

    def call(self, text: str) -> dict[str, Any] | None:
        """The reply as one OpenAI tool call; None when it is not one (cut short by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        name, arguments = (
            (self.name, value) if self.name is not None else (value.get("name"), value.get("arguments"))
        )
        if not isinstance(name, str):
            return None
        return {
            "id": call_id(),
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }


def tool_mode(tools: Any, tool_choice: Any) -> ToolMode | None:
    """The request's tool calling; None when its reply is free text (no tools, or tool_choice none).
    A 400 naming the parameter for what cannot be served."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(tools)
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        raise bad_request(
            'tool_choice "auto" is not supported yet (the model would choose between text and a call): '
            'set tool_choice to "required" or name a function',
            "tool_choice",
            "unsupported_parameter",
        )
    if tool_choice == "required":
        return ToolMode(
            {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": name}, "arguments": parameters},
                        "required": ["name", "arguments"],
                    }
                    for name, parameters in functions.items()
                ]
            },
            None,
        )
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise bad_request(
            'tool_choice must be "none", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in functions:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolMode(functions[name], name)


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """Each tool's name and parameters schema, checked."""
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools"
            )
        parameters = fn.get("parameters") or EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions[name] = parameters
    return functions


class ToolCallReplies:
    """A chat response's choices as tool calls (mode None: as text).

    With a named function the reply is the call's arguments: streamed, its first piece opens the
    call (id, type, name) and every piece adds to `arguments`, as OpenAI streams them, and a reply
    cut by max_tokens is still the call, with finish_reason "length". With "required" the reply
    names the function too, so it is held until it ends and sent as one tool_calls delta (cut
    short, it comes back as text)."""

    def __init__(self, mode: ToolMode | None) -> None:
        self.mode = mode
        self._held: dict[int, list[str]] = {}
        self._ids: dict[int, str] = {}

    def delta(self, index: int, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta and finish reason of a streamed piece of choice `index`."""
        final = "tool_calls" if reason == "stop" else reason
        if self.mode.name is not None:
            if index not in self._ids:
                self._ids[index] = call_id()
                head = {
                    "id": self._ids[index],
                    "type": "function",
                    "function": {"name": self.mode.name, "arguments": text},
                }
                return {"tool_calls": [{"index": 0, **head}]}, final
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), final
        self._held.setdefault(index, []).append(text)
        if reason is None:
            return {}, None
        whole = "".join(self._held.pop(index))
        call = self.mode.call(whole) if reason == "stop" else None
        if call is None:  # cut short (or not a call): the text as it is
            return {"content": whole}, reason
        return {"tool_calls": [{"index": 0, **call}]}, "tool_calls"

    def whole(self, body: dict[str, Any], text: str, reason: str | None) -> dict[str, Any]:
        """A non-streamed choice's body, its message made a tool call when it is one."""
        if self.mode is None:
            return body
        if self.mode.name is not None:
            call = {
                "id": call_id(),
                "type": "function",
                "function": {"name": self.mode.name, "arguments": text},
            }
        else:
            call = self.mode.call(text) if reason == "stop" else None
        if call is not None:
            choice = body["choices"][0]
            choice["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
            choice["finish_reason"] = "tool_calls" if reason == "stop" else reason
        return body


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
