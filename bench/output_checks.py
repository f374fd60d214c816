"""Is an output usable? Tool calls that parse and name the right functions; code that parses."""

from __future__ import annotations

import ast
import codeop
import json
import re
import warnings

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


def code_parses(text: str, truncated: bool = False) -> bool | None:
    """Whether the Python in `text` parses: its fenced blocks joined, else the whole text.
    None when the text holds no code at all (empty). For an output cut by the token budget
    (`truncated`), its last line is dropped and the rest need only be a valid beginning of a
    program: complete, or incomplete but free of syntax errors so far."""
    blocks = _FENCE.findall(text)
    code = "\n".join(blocks) if blocks else text
    if truncated:
        code = code.rsplit("\n", 1)[0] if "\n" in code else ""
    if not code.strip():
        return None
    try:
        if truncated:
            with warnings.catch_warnings():  # e.g. invalid escape sequences in the code
                warnings.simplefilter("ignore")
                codeop.compile_command(code + "\n", symbol="exec")
        else:
            ast.parse(code)
    except (SyntaxError, ValueError, OverflowError):
        return False
    return True
