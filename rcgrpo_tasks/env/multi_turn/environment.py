"""Isolated BFCL v4 multi-turn environment: one per rollout, no globals, no `eval`.

`BfclEnvironment(entry)` builds fresh instances of the entry's bfcl-eval classes (GorillaFileSystem,
TwitterAPI, ...) loaded with a deep copy of `initial_config` (`long_context=True` for that category),
then executes parsed calls by dispatching to public methods of those instances only.

Matches bfcl-eval's `execute_multi_turn_func_call` observably:
- the method table is every public bound method of the involved instances, later classes winning on a
  name clash; a function withheld from the prompt (miss_func) is still callable, as in the official harness;
- results are stringified the same way (str as is; dict -> json.dumps, else str(); anything else str());
- errors become `Error during execution: <message>`; an unknown name gives Python's own
  `name 'x' is not defined`, and bfcl-eval's block-list (`kill`, `exit`, ...) its own message.
Departures: bfcl-eval caches instances in module globals keyed by model name + entry id, so state leaks
between rollouts of the same entry; here every environment owns its instances. And its classes keep
mutable default arguments (`TwitterAPI.post_tweet(tags=[], mentions=[])`; `mention()` extends a tweet's
list in place), so in one bfcl-eval process every tweet posted without mentions shares ONE list for the
life of the process and a verdict depends on what was scored before. Here those defaults belong to a
`DefaultsScope`: fresh copies of the pristine defaults, installed around each call. An environment gets
its own scope, or shares one: the scorer's model and gold environments of an entry share a scope, which
keeps bfcl-eval's behaviour within an entry (the model's and the gold's tweets share that list there too)
and makes every entry score as it would first thing in a fresh process.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
from typing import Any

from rcgrpo_tasks.env.multi_turn.calls import Call, CallParseError, parse_call_string
from rcgrpo_tasks.env.multi_turn.entries import Entry

_BACKEND = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
CLASS_MODULES: dict[str, str] = {
    "GorillaFileSystem": f"{_BACKEND}.gorilla_file_system",
    "MathAPI": f"{_BACKEND}.math_api",
    "MessageAPI": f"{_BACKEND}.message_api",
    "TwitterAPI": f"{_BACKEND}.posting_api",
    "TicketAPI": f"{_BACKEND}.ticket_api",
    "TradingBot": f"{_BACKEND}.trading_bot",
    "TravelAPI": f"{_BACKEND}.travel_booking",
    "VehicleControlAPI": f"{_BACKEND}.vehicle_control",
}
STATELESS_CLASSES = frozenset({"MathAPI"})
# bfcl-eval refuses these names before executing (multi_turn_utils.execute_multi_turn_func_call).
BLOCKED_NAMES = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})


@functools.cache
def env_class(name: str) -> type:
    if name not in CLASS_MODULES:
        raise KeyError(f"unknown BFCL environment class {name!r}")
    return getattr(importlib.import_module(CLASS_MODULES[name]), name)


@functools.cache
def public_methods(name: str) -> tuple[str, ...]:
    """Public method names of a class, as bfcl-eval finds them on an instance (cached per class)."""
    cls = env_class(name)
    return tuple(n for n, m in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_"))


@functools.cache
def method_signature(class_name: str, method: str) -> inspect.Signature:
    """Signature of a bound method (without `self`), cached per class: binding runs once per call scored."""
    sig = inspect.signature(getattr(env_class(class_name), method))
    return sig.replace(parameters=list(sig.parameters.values())[1:])


_SCALARS = (str, int, float, bool, type(None))
_IMMUTABLE = (*_SCALARS, bytes, tuple, frozenset)


@functools.cache
def pristine_defaults(class_name: str) -> dict[str, tuple[tuple | None, dict | None]]:
    """{method: (__defaults__, __kwdefaults__)} of the class's methods that have a mutable default, deep
    copied the first time the class is used here (before any call of ours could mutate them)."""
    cls = env_class(class_name)
    out = {}
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        values = [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
        if any(not isinstance(v, _IMMUTABLE) for v in values):
            out[name] = copy.deepcopy((fn.__defaults__, fn.__kwdefaults__))
    return out


class DefaultsScope:
    """Mutable default arguments of bfcl-eval's methods as one fresh process would have them: each scope
    holds its own deep copy of the pristine defaults and installs them around a call (`call`), so a list
    a method mutates in place is shared within the scope and never beyond it. Single-threaded use."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str], tuple[tuple | None, dict | None]] = {}

    def call(self, class_name: str, method_name: str, bound, args: tuple, kwargs: dict):
        pristine = pristine_defaults(class_name).get(method_name)
        if pristine is None:
            return bound(*args, **kwargs)
        key = (class_name, method_name)
        if key not in self._values:
            self._values[key] = copy.deepcopy(pristine)
        fn = getattr(env_class(class_name), method_name)
        saved = fn.__defaults__, fn.__kwdefaults__
        fn.__defaults__, fn.__kwdefaults__ = self._values[key]
        try:
            return bound(*args, **kwargs)
        finally:
            fn.__defaults__, fn.__kwdefaults__ = saved


def _fresh(values: Any) -> Any:
    """Arguments as the callee may mutate them: copy containers, share immutable scalars (the common case)."""
    if all(type(v) in _SCALARS for v in values):
        return values
    return copy.deepcopy(values)


def stringify(result: Any) -> str:
    """bfcl-eval's stringification of a call result."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except Exception:
            return str(result)
    return str(result)


class BfclEnvironment:
    """Fresh instances of one entry's classes; executes literal-only calls against them."""

    def __init__(self, entry: Entry, scope: DefaultsScope | None = None):
        self.entry = entry
        self.scope = scope if scope is not None else DefaultsScope()
        self.instances: dict[str, Any] = {}
        self._methods: dict[str, tuple[str, str]] = {}  # func name -> (class, method)
        for class_name in entry.involved_classes:
            inst = env_class(class_name)()
            if class_name not in STATELESS_CLASSES:
                inst._load_scenario(copy.deepcopy(entry.initial_config.get(class_name, {})),
                                    long_context=entry.long_context)
            self.instances[class_name] = inst
            for method in public_methods(class_name):
                self._methods[method] = (class_name, method)

    @property
    def function_names(self) -> frozenset[str]:
        return frozenset(self._methods)

    def execute(self, call: Call | str) -> str:
        """Run one call; always returns an observation string (errors included), never raises."""
        if isinstance(call, str):
            try:
                call = parse_call_string(call)
            except CallParseError as exc:
                return f"Error during execution: {exc}"
        if call.name in BLOCKED_NAMES:
            return f"Error during execution: Function call {call.name} is not allowed."
        target = self._methods.get(call.name)
        if target is None:
            return f"Error during execution: name '{call.name}' is not defined"
        method = getattr(self.instances[target[0]], target[1])
        try:
            # Copies: a mutable literal (a parsed Call may be reused) must not alias environment state.
            args, kwargs = _fresh(call.args), {k: _fresh((v,))[0] for k, v in call.kwargs.items()}
            return stringify(self.scope.call(target[0], target[1], method, args, kwargs))
        except Exception as exc:  # the environment's own errors are observations, as in bfcl-eval
            return f"Error during execution: {exc}"

    def execute_step(self, calls: list[Call] | list[str]) -> list[str]:
        return [self.execute(c) for c in calls]

    def bind(self, call: Call) -> tuple[str, tuple] | None:
        """Canonical (name, sorted explicit arguments) of a call, positional args named; None if unbindable."""
        target = self._methods.get(call.name)
        if target is None:
            return None
        try:
            bound = method_signature(*target).bind(*call.args, **call.kwargs)
        except TypeError:
            return None
        bound.apply_defaults()  # `ls()` and `ls(a=False)` are the same call
        return call.name, tuple(sorted((k, repr(v)) for k, v in bound.arguments.items()))

    def state(self) -> dict[str, dict[str, Any]]:
        """Public attributes of every instance (what bfcl-eval's state checker compares)."""
        return {name: {k: v for k, v in vars(inst).items() if not k.startswith("_")}
                for name, inst in self.instances.items()}
