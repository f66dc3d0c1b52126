"""BFCL v4 multi-turn for TRL: a prompt dataset and environments for `GRPOTrainer(environment_factory=...)`
(TRL's dict form), usable with `trl.GRPOTrainer` or `rcgrpo.RCGRPOTrainer`.

- `multi_turn_dataset(...)`: one row per entry: `prompt` (a system message and the paper protocol's ONE merged
  user message, `Step 1: ...\\n\\nStep 2: ...\\n\\nComplete all the steps above ... Call done() ...`), `entry_id`,
  `category`, `environment` (the name of the entry's environment class).
- `multi_turn_environments(entries)`: `{name: environment class}`, one class per combination of BFCL classes
  the entries involve, so each prompt's tool schema holds its entry's classes' functions (and `done`) only.

An environment (`BfclToolEnvironment`): `reset(entry_id, reward_token=None, **row)` builds a fresh
`env.multi_turn.environment.BfclEnvironment` (the pipeline's isolated instances: nothing shared between
environments or rollouts) and returns the goal text of the row's reward token (`rcgrpo.goal.format_goal`:
TRL appends it to the prompt's last message, the merged user message, so it lands where the paper puts it) or
None. Its public methods are the BFCL functions as TRL tools (`tool_schema`); each call is rendered as a BFCL
call string (`Call.to_string`), recorded, and executed from that string through `BfclEnvironment.execute`,
as the pipeline's episodes execute a parsed call (results stringified as bfcl-eval does, errors as
`Error during execution: ...` observations; never bfcl-eval's `eval`). `get_reward()` is the paper reward
(`env.multi_turn.scoring.score_entry` of the recorded calls: final state equal to the gold replay's and every
gold call made), so TRL needs no reward function.

Departures from the pipeline's paper protocol (`env.multi_turn.episode`):
- function-calling mode: the docs reach the model as the chat template's tool schemas, not as text in the
  system prompt, and calls are the template's tool-call blocks, not `[f(a=1)]` text;
- each call is its own step in the recorded result (`[[[call], [call], ...]]`): a tool sees one call, not the
  model output it came in (the paper reward ignores step and turn boundaries);
- `done()` is a tool: it ends the episode for the environment (later calls are neither executed nor recorded),
  but TRL's loop goes on until the model answers without a call; the pipeline's bound on model outputs
  (`max_outputs`) is TRL's `max_tool_calling_iterations`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import ClassVar

from datasets import Dataset

from rcgrpo.goal import GOAL_TEMPLATE, check_template, format_goal
from rcgrpo_tasks.env.multi_turn.calls import Call
from rcgrpo_tasks.env.multi_turn.entries import CATEGORIES, TASK_NAME, Entry, entry_docs
from rcgrpo_tasks.env.multi_turn.environment import BfclEnvironment
from rcgrpo_tasks.env.multi_turn.episode import PAPER_BEHAVIOR, merged_user_message
from rcgrpo_tasks.env.multi_turn.scoring import score_entry
from rcgrpo_tasks.env.prompt import BFCL_CLASSIC
from rcgrpo_tasks.integrations.sources import task_entries
from rcgrpo_tasks.integrations.tool_schema import tool_method

DONE_OBSERVATION = "All steps are marked finished; no further calls will be executed."
AFTER_DONE = "Error during execution: done() was called; this call was not executed."
RESERVED = frozenset({"reset", "get_reward", "done", "result", "bfcl_environment", "entry", "entries", "classes",
                      "goal_template"})
"""Names of `BfclToolEnvironment` itself, which no BFCL function may take."""


def system_prompt(style: str = "bfcl") -> str:
    """The system message in function-calling mode: BFCL's classic persona and task (`bfcl`, without its
    prompting-mode call format and docs, which the template's tool schema replaces) and the paper protocol's
    behaviour paragraph; `short`: the paragraph alone."""
    if style == "short":
        return PAPER_BEHAVIOR
    if style == "bfcl":
        return f"{BFCL_CLASSIC['persona']}{BFCL_CLASSIC['task']}\n\n{PAPER_BEHAVIOR}"
    raise ValueError(f"system prompt style must be 'bfcl' or 'short', got {style!r}")


def environment_name(entry: Entry) -> str:
    """The environment (and class) name of an entry: `bfcl_` + its involved classes in order (a metric-safe
    name: TRL logs an environment's reward as `rewards/<class name>/mean`)."""
    return "bfcl_" + "_".join(entry.involved_classes)


def prompt_messages(entry: Entry, style: str = "bfcl") -> list[dict]:
    """System message + the paper protocol's merged user message (no reward goal: `reset()` returns it)."""
    return [{"role": "system", "content": system_prompt(style)},
            {"role": "user", "content": merged_user_message(entry)}]


def multi_turn_dataset(categories: Iterable[str] | None = CATEGORIES, side: str | None = None,
                       entries_path: str | Path | None = None, split_path: str | Path | None = None,
                       system_prompt_style: str = "bfcl") -> Dataset:
    """A TRL prompt dataset of multi-turn entries (`sources.task_entries` says which): columns `prompt`,
    `entry_id`, `category`, `environment` (pass `multi_turn_environments(entries)` as `environment_factory`;
    `multi_turn_entries` gives the same entries)."""
    chosen = multi_turn_entries(categories, side, entries_path, split_path)
    return Dataset.from_list([{"prompt": prompt_messages(e, system_prompt_style), "entry_id": e.id,
                               "category": e.category, "environment": environment_name(e)} for e in chosen])


def multi_turn_entries(categories: Iterable[str] | None = CATEGORIES, side: str | None = None,
                       entries_path: str | Path | None = None, split_path: str | Path | None = None) -> list[Entry]:
    """The multi-turn entries a dataset of the same arguments holds, in order."""
    return task_entries(TASK_NAME, categories, side, entries_path, split_path)


def paper_docs(entry: Entry) -> list[dict]:
    """Every function doc of the entry's classes: the paper protocol shows them all from the start (a miss_func
    entry's held-back docs included; `done` is added by the environment)."""
    visible, held = entry_docs(entry)
    return visible + [d for turn in sorted(held) for d in held[turn]]


class BfclToolEnvironment:
    """One rollout's BFCL environment for TRL (module docstring); subclasses (`environment_class`) carry the
    tools of one combination of BFCL classes and the entries they may be reset to."""

    entries: ClassVar[Mapping[str, Entry]] = MappingProxyType({})
    classes: ClassVar[tuple[str, ...]] = ()
    goal_template: ClassVar[str] = GOAL_TEMPLATE

    def __init__(self) -> None:
        self.entry: Entry | None = None
        self._env: BfclEnvironment | None = None
        self._calls: list[str] = []
        self._finished = False

    def reset(self, entry_id: str | None = None, reward_token: str | None = None, reward_goal: str | None = None,
              **row) -> str | None:
        """Start the rollout of `entry_id` on fresh BFCL instances; return the goal text TRL appends to the
        prompt: the row's `reward_goal` where `rcgrpo.RCGRPOTrainer` set one ('' when its prompt carries the
        goal already: None then), else the goal of `reward_token` (None without a token)."""
        if entry_id not in self.entries:
            raise ValueError(f"{type(self).__name__}: entry_id {entry_id!r} is not one of its entries (BFCL classes "
                             f"{list(self.classes)}; the row's `environment` must be its entry's)")
        self.entry = self.entries[entry_id]
        self._env = BfclEnvironment(self.entry)
        self._calls, self._finished = [], False
        if reward_goal is not None:
            return reward_goal or None
        return format_goal(reward_token, self.goal_template) or None

    @property
    def result(self) -> list[list[list[str]]]:
        """The executed calls in BFCL's result layout under the paper protocol: one turn, one call per step."""
        return [[[c] for c in self._calls]]

    @property
    def bfcl_environment(self) -> BfclEnvironment | None:
        """The rollout's BFCL instances (None before `reset`)."""
        return self._env

    def get_reward(self) -> float:
        """The paper reward of the calls so far (1.0 or 0.0)."""
        if self.entry is None:
            raise RuntimeError(f"{type(self).__name__}: get_reward() before reset()")
        return score_entry(self.entry, self.result).paper_reward

    # A tool: its docstring is the paper protocol's `done` doc (`episode.DONE_DOC`), and it has no return
    # annotation, which transformers would add to the schema the prompt shows.
    def done(self):
        """Call this when you have finished all the steps."""
        self._finished = True
        return DONE_OBSERVATION

    def _execute(self, name: str, arguments: dict) -> str:
        if self._env is None:
            raise RuntimeError(f"{type(self).__name__}: {name}() before reset()")
        if self._finished:
            return AFTER_DONE
        text = Call(name, (), dict(arguments)).to_string()
        self._calls.append(text)
        return self._env.execute(text)  # the string the scorer replays: live and scored execution cannot differ


def environment_class(entries: list[Entry], goal_template: str = GOAL_TEMPLATE,
                      short_descriptions: bool = False) -> type[BfclToolEnvironment]:
    """The environment class of entries that involve the same BFCL classes (in the same order)."""
    combos = {e.involved_classes for e in entries}
    if len(combos) != 1:
        raise ValueError(f"one environment class serves one combination of BFCL classes, got {sorted(combos)}")
    docs = paper_docs(entries[0])
    clash = sorted({d["name"] for d in docs} & RESERVED)
    if clash:
        raise ValueError(f"{entries[0].id}: BFCL function(s) {clash} would shadow the environment's own names")
    namespace = {d["name"]: tool_method(d, short_descriptions) for d in docs}
    namespace.update(entries=MappingProxyType({e.id: e for e in entries}), classes=entries[0].involved_classes,
                     goal_template=check_template(goal_template), __module__=__name__,
                     __doc__=f"BFCL tools of {', '.join(entries[0].involved_classes)} (and done).")
    return type(environment_name(entries[0]), (BfclToolEnvironment,), namespace)


def multi_turn_environments(entries: Iterable[Entry], goal_template: str = GOAL_TEMPLATE,
                            short_descriptions: bool = False) -> dict[str, type[BfclToolEnvironment]]:
    """TRL's dict-form `environment_factory` for these entries: `{environment name: class}` (a class is its own
    factory), one per combination of BFCL classes. `goal_template`: RCGRPOConfig's `reward_goal_template`.
    `short_descriptions`: each function's own description without BFCL's blurb about its class
    (`tool_schema.function_description`; prompts of 2.5k-5.3k SmolLM2 tokens become ~20 % shorter)."""
    groups: dict[str, list[Entry]] = {}
    for e in entries:
        if getattr(e, "task", None) != TASK_NAME:
            raise ValueError(f"{getattr(e, 'id', e)!r}: not a multi-turn entry")
        groups.setdefault(environment_name(e), []).append(e)
    if not groups:
        raise ValueError("no entries: an environment factory needs at least one multi-turn entry")
    return {name: environment_class(group, goal_template, short_descriptions) for name, group in groups.items()}
