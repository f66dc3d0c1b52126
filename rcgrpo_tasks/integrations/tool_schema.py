"""BFCL function docs as TRL tools: typed Python functions whose signature, type hints and Google-style
docstring make transformers' `get_json_schema` (what TRL renders tools with) give back the BFCL doc.

A tool is built from data, never from code text (no `exec`): one generic body, `self._execute(name, kwargs)`,
with `__name__`, `__signature__`, `__annotations__` and `__doc__` set from the doc. The signature is what the
schema shows; the body forwards whatever arguments arrive, so a wrong argument fails inside the BFCL class as it
does in the pipeline's episodes (an `Error during execution: ...` observation), not in Python's call machinery.

What the schema holds, against BFCL's doc:
- types: string -> str, integer -> int, float / number -> float, boolean -> bool, array -> list[<items>],
  dict / object -> dict, tuple -> list, any -> Any;
- required parameters are those the doc lists as required; every parameter is keyword-only;
- descriptions are the doc's, whitespace collapsed; a parameter's default (which transformers' schema has no
  field for) is appended as ` Default: <JSON>.`, and a dict parameter's documented keys as
  ` Keys: <key> (<type>): <description>; ...` (its nested `properties`, which type hints cannot carry);
- the doc's `response` schema is not shown (chat templates ignore return schemas);
- `short=True` keeps a function description's own part (after BFCL's `Tool description:`), dropping the blurb
  about its class that BFCL repeats in every function of the class (about a fifth of the prompt).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

BFCL_TYPE_HINTS: dict[str, Any] = {
    "string": str, "integer": int, "float": float, "number": float, "boolean": bool,
    "dict": dict, "object": dict, "tuple": list, "any": Any,
}


def param_hint(spec: dict, where: str) -> Any:
    """The Python type hint of one BFCL parameter spec; ValueError naming `where` for a type it cannot carry."""
    kind = spec.get("type")
    if kind == "array":
        items = spec.get("items")
        return list[param_hint(items, f"{where} items")] if items else list
    if kind not in BFCL_TYPE_HINTS:
        raise ValueError(f"{where}: BFCL type {kind!r} has no type hint (known: array, {', '.join(BFCL_TYPE_HINTS)})")
    return BFCL_TYPE_HINTS[kind]


def one_line(text: str) -> str:
    """Whitespace collapsed: a docstring argument description must stay on its line (transformers splits the
    `Args:` block at `<newline> <name>:`)."""
    return " ".join(str(text).split())


def param_description(name: str, spec: dict) -> str:
    """The doc's description (the parameter's name if it has none) + its default and its documented keys."""
    text = one_line(spec.get("description", "")) or name
    keys = spec.get("properties") or {}
    if keys:
        text += " Keys: " + "; ".join(f"{k} ({v.get('type', 'any')}): {one_line(v.get('description', ''))}"
                                      for k, v in keys.items()) + "."
    if "default" in spec:
        text += f" Default: {json.dumps(spec['default'])}."
    return text


def function_description(doc: dict, short: bool = False) -> str:
    """The doc's description on one line; `short`: the part after `Tool description:` (the function's own)."""
    text = doc.get("description", "")
    if short and "Tool description:" in text:
        text = text.split("Tool description:", 1)[1]
    return one_line(text) or doc["name"]


def tool_docstring(doc: dict, short: bool = False) -> str:
    """A Google-style docstring: the description, then `Args:` with one line per parameter."""
    props = (doc.get("parameters") or {}).get("properties") or {}
    text = function_description(doc, short)
    if props:
        text += "\n\nArgs:\n" + "\n".join(f"    {n}: {param_description(n, s)}" for n, s in props.items())
    return text


def tool_signature(doc: dict) -> tuple[inspect.Signature, dict[str, Any]]:
    """(signature with `self` and keyword-only parameters, annotations) of a BFCL doc. A parameter the doc does
    not require gets the doc's default (None where it gives none): only its presence matters to the schema."""
    params = (doc.get("parameters") or {}).get("properties") or {}
    required = set((doc.get("parameters") or {}).get("required") or ())
    unknown = sorted(required - set(params))
    if unknown:
        raise ValueError(f"{doc['name']}: required parameter(s) {unknown} not among its properties")
    annotations = {n: param_hint(s, f"{doc['name']}.{n}") for n, s in params.items()}
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for n, s in params.items():
        default = inspect.Parameter.empty if n in required else s.get("default")
        parameters.append(inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotations[n]))
    return inspect.Signature(parameters), annotations


def tool_method(doc: dict, short: bool = False) -> Callable:
    """A method `name(self, **arguments)` that runs `self._execute(name, arguments)`, described by `doc`
    (`short`: `function_description`'s)."""
    name = doc.get("name")
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"BFCL function name {name!r} is not a public Python identifier")
    signature, annotations = tool_signature(doc)

    def tool(self, **arguments):
        return self._execute(name, arguments)

    tool.__name__ = tool.__qualname__ = name
    tool.__signature__ = signature
    tool.__annotations__ = annotations
    tool.__doc__ = tool_docstring(doc, short)
    return tool
