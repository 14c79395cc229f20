"""Tool definitions and tool calls in a chat row, as the chat template reads them: stored as JSON text (OpenAI's
form for arguments; many datasets for the tools and the whole conversation), they are parsed to objects, as Axolotl
parses them (from v0.13; the conversation from v0.17)."""

from __future__ import annotations

from llmtune.train.data.base import RowError


def json_text(text: str, where: str, kind: type):
    """A field stored as JSON text (Axolotl parses messages, tool-call arguments and tool parameters so)."""
    import json

    try:
        value = json.loads(text)
    except ValueError as err:
        raise RowError(f"{where} is text but not JSON ({err})") from None
    if not isinstance(value, kind):
        raise RowError(f"{where} is JSON text of a {type(value).__name__}, not a {kind.__name__}")
    return value


def parsed_calls(calls, where: str):
    """tool_calls with each function's arguments as an object: arguments stored as JSON text (OpenAI's form) would
    be written by a template's `tojson` as an escaped string, and trained so."""
    if not isinstance(calls, list):
        return calls
    parsed = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            arguments = json_text(function["arguments"], f"{where}[{index}].function.arguments", object)
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return parsed


def tools_of(row: dict, spec) -> list | None:
    """The row's tool definitions for the chat template (a list, or its JSON text), each function's parameters
    as an object, or None."""
    tools = row.get(spec.field_tools)
    if isinstance(tools, str) and tools.strip():
        tools = json_text(tools, f"'{spec.field_tools}'", list)
    if tools in (None, "", []):
        return None
    if not isinstance(tools, list):
        raise RowError(f"'{spec.field_tools}' must be a list of tool definitions")
    parsed = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("parameters"), str):
            where = f"'{spec.field_tools}'[{index}].function.parameters"
            tool = {**tool, "function": {**function, "parameters": json_text(function["parameters"], where, dict)}}
        parsed.append(tool)
    return parsed
