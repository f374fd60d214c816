"""Is an output usable? Tool calls that parse and name the right functions; code that parses."""

from __future__ import annotations

import ast
import json
import re

_FENCE = re.compile(r"```(?:[a-zA-Z0-9_+-]*)\n(.*?)(?:```|$)", re.DOTALL)


def tool_calls(text: str) -> list[tuple[str, frozenset[str]]] | None:
    """The calls of the first JSON list in `text` as (function name, argument keys), or None when
    there is none or it is not a list of {"name": str, "arguments": object}."""
    start = text.find("[")
    while start != -1:
        try:
            parsed, _ = json.JSONDecoder().raw_decode(text[start:])
        except json.JSONDecodeError:
            start = text.find("[", start + 1)
            continue
        return _as_calls(parsed)
    return None


def _as_calls(parsed) -> list[tuple[str, frozenset[str]]] | None:
    if not isinstance(parsed, list):
        return None
    calls = []
    for call in parsed:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        calls.append((call["name"], frozenset(arguments)))
    return calls


def code_parses(text: str) -> bool | None:
    """Whether the Python in `text` parses: its fenced blocks joined, else the whole text.
    None when the text holds no code at all (empty)."""
    blocks = _FENCE.findall(text)
    code = "\n".join(blocks) if blocks else text
    if not code.strip():
        return None
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True
