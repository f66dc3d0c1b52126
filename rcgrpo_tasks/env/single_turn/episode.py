"""A single-turn BFCL entry as an episode: one prompt, one model output, scored by BFCL's AST checker.

`SingleTurnEpisode` has the multi-turn `Episode`'s interface (`messages`, `step`, `done`, `termination`,
`result`, `score`), so the rollout engine, evaluation, RL and the data stages drive both tasks the same way.
The episode ends after the first model output (`completed`). Both prompt protocols give the same
conversation here (there are no turns to merge and no `done()`); the trajectory records the protocol the
pipeline was configured with.

Scoring: the output text is decoded with the project's safe decoder as bfcl-eval's
`default_decode_ast_prompting` decodes it (`env.ast_decode`) and checked with BFCL's AST semantics
(`env.single_turn.ast_check`): `valid` = BFCL's verdict, `error_type` = its error type (`ast_decoder:decoder_failed`
for an output that does not decode, ...). `paper_reward` = `valid` (the paper's binary reward is the
task's success), `partial_credit` = the fraction of gold calls matched one-to-one by a model call.
`result` = `[[call strings]]` (one turn, one step: the decoded calls rendered canonically), so a trajectory
file is also a result file `rcgrpo score` reads.
"""

from __future__ import annotations

from rcgrpo.goal import format_goal
from rcgrpo_tasks.env import ast_decode
from rcgrpo_tasks.env.prompt import BFCL_CLASSIC, BFCL_OUTPUT_FORMAT, BFCL_PLAINTEXT, ProtocolConfig
from rcgrpo_tasks.env.rewards import EntryScore
from rcgrpo_tasks.env.single_turn import ast_check
from rcgrpo_tasks.env.single_turn.entries import SingleTurnEntry, docs_text, hinted, render_calls


def system_prompt(entry: SingleTurnEntry, cfg: ProtocolConfig) -> str:
    """BFCL's default prompting-mode system prompt with the entry's docs in `cfg.doc_style`."""
    tool_call_format = BFCL_CLASSIC["tool_call_no_tag"].format(output_format=BFCL_OUTPUT_FORMAT, param_types="")
    fmt, functions = docs_text(hinted(entry.functions), cfg.doc_style)
    tools = BFCL_CLASSIC["available_tools"].format(format=fmt, functions=functions)
    if cfg.system_prompt == "short":
        return f"{tool_call_format}\n\n{tools}"
    return BFCL_PLAINTEXT.format(persona=BFCL_CLASSIC["persona"], task=BFCL_CLASSIC["task"],
                                 tool_call_format=tool_call_format,
                                 multiturn_behavior=BFCL_CLASSIC["multiturn_behavior"], available_tools=tools)


def initial_messages(entry: SingleTurnEntry, cfg: ProtocolConfig, reward_token: str | None = None) -> list[dict]:
    """System prompt (+ the entry's own system message, appended as BFCL does) and the question; the reward
    goal is appended to the first user message."""
    sys_text = system_prompt(entry, cfg)
    msgs = [dict(m) for m in entry.question]
    if msgs and msgs[0]["role"] == "system":
        msgs[0]["content"] = sys_text + "\n\n" + msgs[0]["content"]
    else:
        msgs.insert(0, {"role": "system", "content": sys_text})
    if reward_token:
        first_user = next(m for m in msgs if m["role"] == "user")
        first_user["content"] += format_goal(reward_token)
    return msgs


def score_text(entry: SingleTurnEntry, text: str | None) -> EntryScore:
    """Every score of one model output (None: the model produced nothing)."""
    verdict, decoded = ast_check.verdict_of_text(list(entry.functions), list(entry.possible_answer), entry.category,
                                                 text or "")
    matched = ast_check.matched_calls(list(entry.functions), decoded or [], list(entry.possible_answer))
    partial = matched / len(entry.possible_answer) if entry.possible_answer else float(verdict.valid)
    message = "; ".join(verdict.errors)[:1000] or None
    return EntryScore(verdict.valid, verdict.error_type, message, partial, float(verdict.valid), [verdict.valid])


def result_of(text: str | None) -> list[list[list[str]]]:
    """`[[call strings]]` of a decodable output, `[[]]` otherwise (BFCL result layout, one turn, one step)."""
    try:
        decoded = ast_decode.decode_prompt(text or "")
    except ast_decode.AstDecodeError:
        return [[]]
    return [[render_calls(decoded)]] if ast_decode.is_call_list(decoded) else [[]]


class SingleTurnEpisode:
    """One rollout of a single-turn entry; `step` takes the one model output and ends the episode."""

    def __init__(self, entry: SingleTurnEntry, cfg: ProtocolConfig, reward_token: str | None = None):
        self.entry, self.cfg, self.reward_token = entry, cfg, reward_token
        self.messages: list[dict] = initial_messages(entry, cfg, reward_token)
        self.result: list[list[list[str]]] = [[]]
        self.turn = 0
        self.n_steps = 0
        self.done = False
        self.termination: str | None = None
        self.text: str | None = None

    def terminate(self, reason: str) -> None:
        if not self.done:
            self.done, self.termination = True, reason

    def truncate(self, n_messages: int, reason: str) -> None:
        del self.messages[n_messages:]
        self.terminate(reason)

    def step(self, model_text: str) -> list[dict]:
        if self.done:
            raise RuntimeError(f"{self.entry.id}: step() after the episode ended ({self.termination})")
        self.n_steps += 1
        self.messages.append({"role": "assistant", "content": model_text})
        self.text = model_text
        self.result = result_of(model_text)
        self.terminate("completed")
        return []

    def score(self) -> EntryScore:
        return score_text(self.entry, self.text)
