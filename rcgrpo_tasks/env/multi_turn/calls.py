"""Safe parsing of BFCL-style function calls from model text: data, never code.

Model text such as ``[cd(folder='x'), ls(a=True)]`` (possibly inside a code fence or surrounded by prose)
is parsed with Python's `ast` and accepted only if every call is a bare name called with literal
arguments (numbers, strings, booleans, None, and lists/tuples/dicts/sets of those, with unary +/-).
Everything else — attribute access, dunders, names, nested calls, lambdas, comprehensions, f-strings,
starred arguments, oversized or deeply nested literals — is rejected with a clear message. Nothing is
ever evaluated: values come from `ast.literal_eval` on already-validated nodes.

Departure from bfcl-eval: its checker `eval`s the call string, so a nested call in an argument
(``f(x=g())``) runs `g`. We reject it; no ground-truth call in BFCL v4 multi-turn needs it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

MAX_TEXT_CHARS = 20_000
"""Longer model outputs are truncated before parsing (a 135M model can babble)."""
MAX_NODES = 2_000
"""AST nodes allowed in one call list; bounds parse work on adversarial input."""
MAX_CALLS = 64
"""Calls accepted from one model output."""
MAX_DEPTH = 12
"""Nesting depth of literal containers allowed in an argument."""
MAX_STR_CHARS = 10_000
"""Length of one string literal argument."""
MAX_INT_DIGITS = 40
"""Digits of one integer literal (blocks huge-number CPU bombs in downstream arithmetic)."""

_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\s*\n?(.*?)```", re.S)
# A call-shaped span in prose: a name not preceded by `.` (so `os.system(` is never read as `system(`).
_CALL_START = re.compile(r"(?<![\w.])([A-Za-z_][A-Za-z0-9_]*)\s*\(")


class CallParseError(ValueError):
    """Model text is not an acceptable call / call list."""


@dataclass(frozen=True)
class Call:
    """One function call with literal arguments."""

    name: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to_string(self) -> str:
        """Canonical BFCL form: `f('pos', a=1, b='x')` (repr of each value)."""
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.name}({', '.join(parts)})"

    def __hash__(self) -> int:  # kwargs is a dict; hash the canonical text
        return hash(self.to_string())


@dataclass(frozen=True)
class ParseResult:
    """Calls found in a model output plus what could not be parsed."""

    calls: list[Call]
    errors: list[str]
    raw: str

    @property
    def ok(self) -> bool:
        return bool(self.calls) and not self.errors


def format_calls(calls: list[Call]) -> str:
    """`[f(a=1), g()]`: what a model is trained to emit."""
    return "[" + ", ".join(c.to_string() for c in calls) + "]"


def _check_literal(node: ast.AST, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise CallParseError(f"literal nested deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, str) and len(v) > MAX_STR_CHARS:
            raise CallParseError(f"string literal longer than {MAX_STR_CHARS} characters")
        if isinstance(v, int) and not isinstance(v, bool) and len(str(abs(v))) > MAX_INT_DIGITS:
            raise CallParseError(f"integer literal longer than {MAX_INT_DIGITS} digits")
        if isinstance(v, bytes) or v is Ellipsis:
            raise CallParseError(f"{type(v).__name__} literals are not allowed")
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        if not (isinstance(node.operand, ast.Constant) and isinstance(node.operand.value, (int, float))):
            raise CallParseError("unary +/- only applies to numbers")
        return _check_literal(node.operand, depth + 1)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        for elt in node.elts:
            if isinstance(elt, ast.Starred):
                raise CallParseError("starred expressions are not allowed")
            _check_literal(elt, depth + 1)
        return
    if isinstance(node, ast.Dict):
        for k, v in zip(node.keys, node.values):
            if k is None:
                raise CallParseError("dict unpacking (**) is not allowed")
            _check_literal(k, depth + 1)
            _check_literal(v, depth + 1)
        return
    raise CallParseError(f"argument is not a literal: {type(node).__name__} ({_snippet(node)})")


def _snippet(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # pragma: no cover - unparse of odd nodes
        text = type(node).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _call_from_node(node: ast.AST) -> Call:
    if not isinstance(node, ast.Call):
        raise CallParseError(f"not a function call: {_snippet(node)}")
    if not isinstance(node.func, ast.Name):
        raise CallParseError(f"only bare function names may be called, got {_snippet(node.func)}")
    name = node.func.id
    if name.startswith("_"):
        raise CallParseError(f"private or dunder function {name!r} is not allowed")
    args = []
    for a in node.args:
        if isinstance(a, ast.Starred):
            raise CallParseError(f"starred argument in {name}() is not allowed")
        _check_literal(a)
        args.append(ast.literal_eval(a))
    kwargs: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise CallParseError(f"**kwargs in {name}() is not allowed")
        if kw.arg in kwargs:
            raise CallParseError(f"duplicate keyword {kw.arg!r} in {name}()")
        _check_literal(kw.value)
        kwargs[kw.arg] = ast.literal_eval(kw.value)
    return Call(name=name, args=tuple(args), kwargs=kwargs)


def _parse_expression(text: str) -> list[Call]:
    """Parse text that must be exactly a call or a list/tuple of calls."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise CallParseError(f"not valid call syntax: {getattr(exc, 'msg', exc)}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CallParseError(f"call list larger than {MAX_NODES} syntax nodes")
    body = tree.body
    nodes = body.elts if isinstance(body, (ast.List, ast.Tuple)) else [body]
    if len(nodes) > MAX_CALLS:
        raise CallParseError(f"more than {MAX_CALLS} calls in one output")
    return [_call_from_node(n) for n in nodes]


def parse_call_string(text: str) -> Call:
    """Exactly one call, e.g. an entry of a BFCL result file: `cd(folder='x')`."""
    calls = _parse_expression(text)
    if len(calls) != 1:
        raise CallParseError(f"expected one call, found {len(calls)}: {text[:80]!r}")
    return calls[0]


def _balanced_span(text: str, start: int, open_ch: str, close_ch: str) -> int | None:
    """Index just past the bracket matching text[start] (quote-aware), or None."""
    depth, quote, i = 0, None, start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == open_ch:
            depth += 1
        elif ch == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _candidates(text: str) -> list[str]:
    """Substrings that may hold the call list, most specific first."""
    out = [m.group(1) for m in _FENCE.finditer(text)]
    out.append(text)
    return out


def parse_calls(text: str) -> ParseResult:
    """All calls in a model output, tolerating code fences and prose around a `[...]` call list.

    Order of attempts: each fenced block, then the whole text, each first as a bare expression, then as
    the first bracketed list that parses, then as individual `name(...)` spans found in the prose.
    Returns no calls (and no errors) for plain prose with nothing call-shaped in it.
    """
    raw = text
    text = text[:MAX_TEXT_CHARS]
    first_error: str | None = None
    for cand in _candidates(text):
        stripped = cand.strip()
        if not stripped:
            continue
        try:
            return ParseResult(_parse_expression(stripped), [], raw)
        except CallParseError as exc:
            first_error = first_error or str(exc)
        pos = stripped.find("[")
        while pos != -1:
            end = _balanced_span(stripped, pos, "[", "]")
            if end is None:
                break
            try:
                calls = _parse_expression(stripped[pos:end])
                if calls:
                    return ParseResult(calls, [], raw)
            except CallParseError as exc:
                first_error = first_error or str(exc)
            pos = stripped.find("[", pos + 1)
    return _scan_spans(text, raw, first_error)


def _scan_spans(text: str, raw: str, first_error: str | None) -> ParseResult:
    """Last resort: individual `name(...)` spans anywhere in the text."""
    calls: list[Call] = []
    errors: list[str] = []
    pos = 0
    while (m := _CALL_START.search(text, pos)) is not None:
        open_at = m.end() - 1
        end = _balanced_span(text, open_at, "(", ")")
        if end is None:
            errors.append(f"unbalanced parentheses after {m.group(1)!r}")
            break
        span = text[m.start():end]
        try:
            calls.append(parse_call_string(span))
        except CallParseError as exc:
            errors.append(f"{span[:60]!r}: {exc}")
        pos = end
        if len(calls) > MAX_CALLS:
            return ParseResult([], [f"more than {MAX_CALLS} calls in one output"], raw)
    if not calls and not errors and first_error and ("(" in text):
        errors.append(first_error)
    return ParseResult(calls, errors, raw)
