"""Prompting protocols: how a BFCL entry becomes a conversation, and how model text moves it forward.

`Episode(entry, cfg, reward_token)` is a policy-agnostic state machine: it holds the chat (`messages`),
takes the model's next output (`step(text)`), executes the parsed calls in an isolated environment
(`env.multi_turn.environment`), and returns the messages the environment appends (tool results, next user
turn, miss_func doc injection). Model text is parsed only with `env.multi_turn.calls` (never `eval`).

Two protocols (`ProtocolConfig.protocol`):
- `official` — BFCL's prompting mode, mirroring bfcl-eval's `BaseHandler.inference_multi_turn_prompting`
  and its default system prompt (`constants/default_prompts.py`, `ret_fmt=python&tool_call_tag=False&
  func_doc_fmt=json&prompt_fmt=plaintext&style=classic`): user turns one by one; every model output that
  decodes to calls is executed and each result appended as a `tool` message (`name` = the call); a turn
  ends when the output decodes to no call or fails to decode; after more than `max_steps_per_turn` (20)
  executed steps in one turn the entry is force-terminated (`step_limit`; the result then has fewer turns
  than the ground truth, which the official checker fails). A miss_func turn (empty in the data) becomes
  BFCL's user message `"{held-back docs}\nI have updated some more functions you can choose from. What
  about now?"`. Result: turns -> steps -> call strings, exactly BFCL's layout.
- `paper` — the RC-GRPO paper's format: all turns merged into ONE user message (`Step 1: …\n\nStep 2:
  …\n\nComplete all the steps above using the available tools. Call done() when you have finished all
  tasks.`), all docs visible (there is no turn boundary at which to reveal held-back docs, so miss_func
  turns are skipped), a `done()` tool added. The episode ends at `done()` (`done`), after `max_outputs`
  model outputs (`step_limit`), or — a choice of ours, since nothing new would reach the model — when an
  output decodes to no call (`completed`). Result: one turn holding every step (the paper reward in
  `env.multi_turn.scoring` ignores turn boundaries).

Doc styles (`doc_style`): `official` (bfcl-eval's exact `json.dumps(docs, indent=4)`; held-back docs
injected as Python's `str(list)`, as BFCL does), `json` (one JSON object per line), `compact` (one line per
function; ~10x fewer tokens, the default: the bundled SmolLM2 has an 8k context).
Reward slot: with a reward token, the first user message ends in `rcgrpo.goal.format_goal(token)`.
"""

from __future__ import annotations

import json

from rcgrpo.goal import format_goal
from rcgrpo_tasks.env.multi_turn.calls import format_calls, parse_call_string, parse_calls
from rcgrpo_tasks.env.multi_turn.entries import ADDITIONAL_FUNCTION_PROMPT, Entry, entry_docs, render_docs
from rcgrpo_tasks.env.multi_turn.environment import BfclEnvironment
from rcgrpo_tasks.env.multi_turn.scoring import score_entry
from rcgrpo_tasks.env.prompt import BFCL_CLASSIC, BFCL_OUTPUT_FORMAT, BFCL_PLAINTEXT, ProtocolConfig
from rcgrpo_tasks.env.rewards import EntryScore

DONE_DOC = {
    "name": "done",
    "description": "Call this when you have finished all the steps.",
    "parameters": {"type": "dict", "properties": {}, "required": []},
}
PAPER_INSTRUCTION = "Complete all the steps above using the available tools. Call done() when you have finished all tasks."
PAPER_BEHAVIOR = (
    "The user gives you several steps at once. Complete them in order, calling functions as needed; you will "
    "see each function's result before your next output. When every step is finished, call done()."
)
_FORMAT_NAMES = {"official": "json", "json": "JSON (one function per line)",
                 "compact": "compact `name(param: type = default) -> description`"}


def _docs_text(docs: list[dict], style: str) -> str:
    if style == "official":
        return json.dumps(docs, indent=4)
    return render_docs(docs, style)


def system_prompt(docs: list[dict], cfg: ProtocolConfig) -> str:
    """BFCL's default prompting-mode system prompt with the docs in `cfg.doc_style` (paper: + done())."""
    tool_call_format = BFCL_CLASSIC["tool_call_no_tag"].format(output_format=BFCL_OUTPUT_FORMAT, param_types="")
    behavior = BFCL_CLASSIC["multiturn_behavior"] if cfg.protocol == "official" else PAPER_BEHAVIOR
    tools = BFCL_CLASSIC["available_tools"].format(
        format=_FORMAT_NAMES[cfg.doc_style], functions=_docs_text(docs, cfg.doc_style))
    if cfg.system_prompt == "short":
        return f"{tool_call_format}\n\n{behavior}\n\n{tools}"
    return BFCL_PLAINTEXT.format(persona=BFCL_CLASSIC["persona"], task=BFCL_CLASSIC["task"],
                                 tool_call_format=tool_call_format, multiturn_behavior=behavior,
                                 available_tools=tools)


def held_docs_message(docs: list[dict], style: str) -> dict:
    """BFCL's miss_func injection: `"{functions}\\n" + ADDITIONAL_FUNCTION_PROMPT` as a user message."""
    functions = str(docs) if style == "official" else _docs_text(docs, style)
    return {"role": "user", "content": f"{functions}\n{ADDITIONAL_FUNCTION_PROMPT}"}


def merged_user_message(entry: Entry) -> str:
    """The paper's single user message: `Step 1: …\\n\\nStep 2: …\\n\\n<instruction>` (empty turns skipped)."""
    steps = ["\n".join(m["content"] for m in turn) for turn in entry.turns if turn]
    body = "\n\n".join(f"Step {i}: {text}" for i, text in enumerate(steps, 1))
    return f"{body}\n\n{PAPER_INSTRUCTION}"


def initial_messages(entry: Entry, cfg: ProtocolConfig, reward_token: str | None = None) -> list[dict]:
    """System prompt + first user message(s) of an episode (the prompt shared by a GRPO group per token)."""
    visible, held = entry_docs(entry)
    if cfg.protocol == "paper":
        docs = visible + [d for turn in sorted(held) for d in held[turn]] + [DONE_DOC]
        users = [{"role": "user", "content": merged_user_message(entry)}]
    else:
        docs = visible
        users = _official_turn_messages(entry, 0, held, cfg.doc_style)
    msgs = [{"role": "system", "content": system_prompt(docs, cfg)}] + [dict(m) for m in users]
    if reward_token:
        first_user = next(m for m in msgs if m["role"] == "user")
        first_user["content"] += format_goal(reward_token)
    return msgs


def _official_turn_messages(entry: Entry, turn: int, held: dict[int, list[dict]], style: str) -> list[dict]:
    if turn in entry.missed_function:
        if entry.turns[turn]:
            raise ValueError(f"{entry.id}: holdout turn {turn} should not have a user message")
        return [held_docs_message(held.get(turn, []), style)]
    return [dict(m) for m in entry.turns[turn]]


class Episode:
    """One rollout's conversation state; feed it model outputs with `step` until `done`."""

    def __init__(self, entry: Entry, cfg: ProtocolConfig, reward_token: str | None = None):
        self.entry, self.cfg, self.reward_token = entry, cfg, reward_token
        self.env = BfclEnvironment(entry)
        self._held = entry_docs(entry)[1]
        self.messages: list[dict] = initial_messages(entry, cfg, reward_token)
        self.result: list[list[list[str]]] = [[]]
        self.turn = 0
        self.turn_steps = 0  # executed steps in the current turn (official)
        self.n_steps = 0  # model outputs so far (both protocols)
        self.done = False
        self.termination: str | None = None

    def terminate(self, reason: str) -> None:
        """End the episode from outside (context limit, generation error)."""
        if not self.done:
            self.done, self.termination = True, reason

    def truncate(self, n_messages: int, reason: str) -> None:
        """End the episode, dropping messages after the first `n_messages` (what overflows the context).

        A user turn dropped this way was never shown to the model, so its (empty) result turn goes too.
        """
        dropped = self.messages[n_messages:]
        del self.messages[n_messages:]
        if any(m["role"] == "user" for m in dropped) and len(self.result) > 1 and not self.result[-1]:
            self.result.pop()
            self.turn -= 1
        self.terminate(reason)  # an episode that had already ended keeps its own reason

    def step(self, model_text: str) -> list[dict]:
        """Record the model's output, act on it, and return the messages the environment appends."""
        if self.done:
            raise RuntimeError(f"{self.entry.id}: step() after the episode ended ({self.termination})")
        self.n_steps += 1
        self.messages.append({"role": "assistant", "content": model_text})
        parsed = parse_calls(model_text)
        calls = parsed.calls if parsed.calls and not parsed.errors else []  # any error: BFCL's decode fails
        added = self._step_paper(calls) if self.cfg.protocol == "paper" else self._step_official(calls)
        self.messages.extend(added)
        return added

    def score(self) -> EntryScore:
        """Every score of the trajectory so far (`scoring.score_entry` of `result`)."""
        return score_entry(self.entry, self.result)

    def _execute(self, calls) -> list[dict]:
        strings = [c.to_string() for c in calls]
        self.result[-1].append(strings)
        observations = self.env.execute_step(calls)
        return [{"role": "tool", "name": s, "content": o} for s, o in zip(strings, observations)]

    def _step_official(self, calls) -> list[dict]:
        if calls:
            added = self._execute(calls)
            self.turn_steps += 1
            if self.turn_steps > self.cfg.max_steps_per_turn:  # bfcl: `count > MAXIMUM_STEP_LIMIT`
                self.terminate("step_limit")
            return added
        # No call decoded: the turn is over.
        if self.turn + 1 >= len(self.entry.turns):
            self.terminate("completed")
            return []
        self.turn += 1
        self.turn_steps = 0
        self.result.append([])
        return _official_turn_messages(self.entry, self.turn, self._held, self.cfg.doc_style)

    def _step_paper(self, calls) -> list[dict]:
        done_at = next((i for i, c in enumerate(calls) if c.name == "done"), None)
        work = calls if done_at is None else calls[:done_at]
        added = self._execute(work) if work else []
        if done_at is not None:
            self.terminate("done")
        elif not calls:
            self.terminate("completed")
        elif self.n_steps >= self.cfg.max_outputs:
            self.terminate("step_limit")
        return added


def replay_texts(protocol: str, turns_of_calls, final_text: str) -> list[str]:
    """The model outputs that replay `turns_of_calls` (per turn: call strings = one step, or a list of steps)
    under `protocol`: paper = every step, then `[done()]`; official = each turn's steps, then `final_text`
    (any text that decodes to no call ends a turn)."""
    steps_per_turn = [[list(t)] if t and isinstance(t[0], str) else [list(s) for s in t] for t in turns_of_calls]

    def render(step):
        return format_calls([parse_call_string(c) for c in step])

    if protocol == "paper":
        return [render(s) for steps in steps_per_turn for s in steps if s] + ["[done()]"]
    texts: list[str] = []
    for steps in steps_per_turn:
        texts += [render(s) for s in steps if s] + [final_text]
    return texts
