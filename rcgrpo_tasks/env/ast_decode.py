"""BFCL single-turn model outputs decoded as bfcl-eval decodes them, without ever running them.

`decode_prompt(text)` returns what bfcl-eval's `model_handler.utils.default_decode_ast_prompting(text,
ReturnFormat.PYTHON)` returns, and raises `AstDecodeError` wherever that raises (bfcl-eval's runner then
gives `ast_decoder:decoder_failed`): the text is stripped of backticks, newlines and spaces, wrapped in
`[...]` unless already, parsed with `ast` (literal parsing, nothing evaluated) and each call read as
bfcl-eval's `resolve_ast_call` / `resolve_ast_by_type` read it:
- the name is the dotted `Attribute` chain ending in a `Name` (`math.factorial`; anything else at the base
  is left out, `a().b(x=1)` is `b`); positional arguments are ignored, keyword arguments kept in order
  (a repeated keyword keeps the last value, `**d` is kept under the key None), and every element of the
  list must be a call;
- constants as they are (`...` -> `"..."`), lists, tuples, dicts (an unhashable key fails), a name -> its
  text, a nested call without keywords -> its source text (`ast.unparse`), with keywords -> `{name: args}`,
  a subscript -> `value[slice]` as text;
- a unary operator on a constant NEGATES it whatever the operator (`+5` -> -5, `not True` -> -1, `~3` ->
  -3), and fails on anything but a number (bfcl-eval computes `-operand.value`);
- a lambda fails (bfcl-eval indexes the lambda's body expression, which raises); sets, attributes,
  comparisons, f-strings, comprehensions, conditionals and every other node fail.

`decode_fc(result)` is a function-calling handler's `decode_ast` (OpenAI, Claude, Mistral): a list of
`{name: "<JSON arguments>"}`; `is_call_list` is bfcl-eval's `is_function_calling_format_output`.

Departures from bfcl-eval (each one a refusal, i.e. `ast_decoder:decoder_failed`, where bfcl-eval decodes):
- arithmetic (`BinOp`): bfcl-eval runs `eval(ast.unparse(node))`, code execution on model text. Here a
  constant folder computes it over literals only (numbers, strings, bytes, booleans, None, lists, tuples,
  sets and dicts of those, unary and binary operators, with Python's own semantics and errors) and refuses
  any other node inside the arithmetic (names, calls, attributes, comparisons: bfcl-eval would evaluate
  those in its module's namespace), printf-style `str % x` (its width is unbounded), an integer result over
  `MAX_INT_BITS` bits, and more than `MAX_FOLD_WEIGHT` elements + characters built by arithmetic in one
  output (`[0] * 10**9`);
- outputs over `MAX_TEXT_CHARS` characters or `MAX_NODES` syntax nodes, values nested deeper than
  `MAX_DEPTH`;
- `decode_fc` also takes arguments that are already objects (`{name: {...}}`, as the Gemini handler's
  results hold them), where the OpenAI handler's `json.loads` fails on them.
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

MAX_TEXT_CHARS = 100_000
"""Longest model output decoded (a babbling model's 4k tokens are ~16k characters)."""
MAX_NODES = 20_000
"""Syntax nodes allowed in one output; bounds the work on adversarial input."""
MAX_DEPTH = 200
"""Nesting depth of values (lists in lists, operators on operators) read from one output. Python's parser
allows 200 nested brackets, so only long operator chains (`1+1+...+1`, 200 terms) reach it."""
MAX_INT_BITS = 4096
"""Largest integer arithmetic may produce (about 1,230 digits; literals are Python's own 4,300 digits)."""
MAX_FOLD_WEIGHT = 100_000
"""Elements + characters arithmetic may build in one output."""


class AstDecodeError(ValueError):
    """Model output that bfcl-eval's decoder would fail on (or that this decoder refuses to compute)."""


_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift,
    ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.BitAnd: operator.and_,
    ast.MatMult: operator.matmul,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert, ast.Not: operator.not_}
_SEQUENCES = (str, bytes, list, tuple)


def _snippet(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except RecursionError:
        return type(node).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int)  # bool included, as Python's arithmetic treats it


def _weight(v: Any) -> int:
    """Elements + characters of a folded value (what a `repr` or a comparison of it costs)."""
    if isinstance(v, (str, bytes)):
        return max(1, len(v))
    if isinstance(v, (list, tuple, set, frozenset)):
        return 1 + sum(_weight(x) for x in v)
    if isinstance(v, dict):
        return 1 + sum(_weight(k) + _weight(x) for k, x in v.items())
    return 1


class _Decoder:
    """One output's decoding; `folded` counts the weight arithmetic has built so far."""

    def __init__(self) -> None:
        self.folded = 0

    def call(self, node: ast.Call, depth: int) -> dict:
        parts = []
        func = node.func
        while isinstance(func, ast.Attribute):
            parts.append(func.attr)
            func = func.value
        if isinstance(func, ast.Name):
            parts.append(func.id)
        args: dict = {}
        for kw in node.keywords:
            args[kw.arg] = self.value(kw.value, depth + 1)
        return {".".join(reversed(parts)): args}

    def value(self, node: ast.AST | None, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise AstDecodeError(f"values nested deeper than {MAX_DEPTH} levels (refused)")
        if isinstance(node, ast.Constant):
            return "..." if node.value is Ellipsis else node.value
        if isinstance(node, ast.UnaryOp):
            return _negate(node)
        if isinstance(node, ast.List):
            return [self.value(v, depth + 1) for v in node.elts]
        if isinstance(node, ast.Dict):
            return self.mapping(node, depth)
        if isinstance(node, ast.BinOp):
            return self.fold(node, depth)
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Call):
            return self.call(node, depth) if node.keywords else ast.unparse(node)
        if isinstance(node, ast.Tuple):
            return tuple(self.value(v, depth + 1) for v in node.elts)
        if isinstance(node, ast.Lambda):
            raise AstDecodeError(f"unsupported lambda argument: {_snippet(node)}")
        if isinstance(node, ast.Subscript):
            return ast.unparse(node.value) + "[" + ast.unparse(node.slice) + "]"
        raise AstDecodeError(f"Unsupported AST type: {type(node).__name__}")

    def mapping(self, node: ast.Dict, depth: int) -> dict:
        try:
            return {self.value(k, depth + 1): self.value(v, depth + 1) for k, v in zip(node.keys, node.values)}
        except TypeError as exc:  # an unhashable key ([1]: ...), as the dict comprehension raises it
            raise AstDecodeError(f"dict key: {exc}") from None

    def fold(self, node: ast.AST, depth: int) -> Any:
        """A constant expression's value with Python's semantics; anything that is not a literal is refused."""
        if depth > MAX_DEPTH:
            raise AstDecodeError(f"arithmetic nested deeper than {MAX_DEPTH} levels (refused)")
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = [self.fold(v, depth + 1) for v in node.elts]
            return _apply({ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)], items)
        if isinstance(node, ast.Dict) and None not in node.keys:
            pairs = [(self.fold(k, depth + 1), self.fold(v, depth + 1)) for k, v in zip(node.keys, node.values)]
            return _apply(dict, pairs)
        if isinstance(node, ast.UnaryOp):
            return _apply(_UNARY[type(node.op)], self.fold(node.operand, depth + 1))
        if isinstance(node, ast.BinOp):
            left, right = self.fold(node.left, depth + 1), self.fold(node.right, depth + 1)
            return self.binop(node.op, left, right)
        raise AstDecodeError(f"{type(node).__name__} inside arithmetic ({_snippet(node)}) is refused: "
                             "bfcl-eval would evaluate it as code")

    def binop(self, op: ast.operator, left: Any, right: Any) -> Any:
        kind = type(op)
        if kind is ast.Mod and isinstance(left, (str, bytes)):
            raise AstDecodeError("printf-style formatting (str % x) inside arithmetic is refused")
        if kind is ast.Pow and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1 \
                and (abs(left).bit_length() - 1) * right + 1 > MAX_INT_BITS:
            raise AstDecodeError(f"arithmetic result over {MAX_INT_BITS} bits (refused)")
        if kind is ast.LShift and _is_int(left) and _is_int(right) and left and right > 0 \
                and abs(left).bit_length() + right > MAX_INT_BITS:
            raise AstDecodeError(f"arithmetic result over {MAX_INT_BITS} bits (refused)")
        if kind is ast.Mult:
            seq, times = (left, right) if isinstance(left, _SEQUENCES) else (right, left)
            if isinstance(seq, _SEQUENCES) and _is_int(times) and times > 0:
                self.spend(_weight(seq) * times, dry=True)
        result = _apply(_BINOPS[kind], left, right)
        if _is_int(result) and result.bit_length() > MAX_INT_BITS:
            raise AstDecodeError(f"arithmetic result over {MAX_INT_BITS} bits (refused)")
        self.spend(_weight(result))
        return result

    def spend(self, weight: int, dry: bool = False) -> None:
        """Count what arithmetic built; `dry`: only check that `weight` more would still fit."""
        if not dry:
            self.folded += weight
        if self.folded + (weight if dry else 0) > MAX_FOLD_WEIGHT:
            raise AstDecodeError(f"arithmetic builds more than {MAX_FOLD_WEIGHT} elements + characters (refused)")


def _apply(fn, *operands: Any) -> Any:
    try:
        return fn(*operands)
    except (TypeError, ValueError, ArithmeticError) as exc:  # Python's own error for these operands
        raise AstDecodeError(f"arithmetic failed: {type(exc).__name__}: {exc}") from None


def _negate(node: ast.UnaryOp) -> Any:
    """bfcl-eval's unary rule: `-operand.value`, whatever the operator; only a constant has a number there."""
    if not isinstance(node.operand, ast.Constant):
        raise AstDecodeError(f"unary operator on a non-constant: {_snippet(node)}")
    return _apply(operator.neg, node.operand.value)


def _parse(text: str) -> ast.expr:
    if len(text) > MAX_TEXT_CHARS:
        raise AstDecodeError(f"output longer than {MAX_TEXT_CHARS} characters (refused)")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise AstDecodeError(f"invalid syntax: {exc}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise AstDecodeError(f"output larger than {MAX_NODES} syntax nodes (refused)")
    return tree.body


def decode_prompt(text: str) -> list[dict]:
    """`[{name: {param: value}}]` of a prompt-mode output, as bfcl-eval's `default_decode_ast_prompting`."""
    if not isinstance(text, str):
        raise AstDecodeError(f"model output is {type(text).__name__}, expected text")
    text = text.strip("`\n ")
    if not text.startswith("["):
        text = "[" + text
    if not text.endswith("]"):
        text = text + "]"
    body = _parse(text.strip().strip("'"))
    try:
        return _calls(body)
    except (RecursionError, MemoryError) as exc:  # ast.unparse of a deep nested call, as in bfcl-eval
        raise AstDecodeError(f"output too deeply nested ({type(exc).__name__})") from None


def _calls(body: ast.expr) -> list[dict]:
    decoder = _Decoder()
    if isinstance(body, ast.Call):
        return [decoder.call(body, 0)]
    if not isinstance(body, (ast.List, ast.Tuple, ast.Set)):
        raise AstDecodeError(f"not a call or a list of calls: {type(body).__name__}")
    out = []
    for elem in body.elts:
        if not isinstance(elem, ast.Call):
            raise AstDecodeError(f"list element is not a function call: {_snippet(elem)}")
        out.append(decoder.call(elem, 0))
    return out


def decode_fc(result: Any) -> list[dict]:
    """`[{name: args}]` of a function-calling result `[{name: "<JSON arguments>"}]`, as the OpenAI handler's
    `decode_ast`: the first key of each object is the name; argument text is `json.loads`-ed (arguments that
    are already an object are taken as they are). The handler iterates the result: an empty string (or
    object) is no call at all, `[]`; any other text fails on its first character."""
    if isinstance(result, (str, dict)) and not result:
        return []
    if not isinstance(result, list):
        raise AstDecodeError(f"a function-calling result is a list of {{name: arguments}} objects, "
                             f"got {type(result).__name__}")
    out = []
    for i, item in enumerate(result):
        if not isinstance(item, dict) or not item:
            raise AstDecodeError(f"call {i}: expected a {{name: arguments}} object, got {type(item).__name__}")
        name = next(iter(item))
        args = item[name]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError) as exc:
                raise AstDecodeError(f"call {i} ({name}): arguments are not JSON: {exc}") from None
        elif not isinstance(args, dict):
            raise AstDecodeError(f"call {i} ({name}): arguments are {type(args).__name__}, expected JSON text")
        out.append({name: args})
    return out


def is_call_list(decoded: Any) -> bool:
    """bfcl-eval's `is_function_calling_format_output`: a list of one-key `{name: {params}}` dicts ([] is)."""
    if type(decoded) is not list:
        return False
    for item in decoded:
        if type(item) is not dict or len(item) != 1 or type(next(iter(item.values()))) is not dict:
            return False
    return True
