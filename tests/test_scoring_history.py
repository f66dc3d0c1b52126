"""Verdicts never depend on what the same process scored before (env.multi_turn.environment.DefaultsScope).

bfcl-eval's `TwitterAPI.post_tweet(tags=[], mentions=[])` keeps mutable default lists and `mention()`
extends a tweet's list in place, so in one bfcl-eval process a `mention()` on a tweet posted without
mentions changes the mentions of every later such tweet. The scorer executes every turn (bfcl-eval stops
at the first failing one), so calls bfcl-eval never runs would leak into later entries."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from helpers import get_entry

from rcgrpo_tasks.env.multi_turn.environment import BfclEnvironment, env_class, pristine_defaults
from rcgrpo_tasks.env.multi_turn.scoring import score_entry

SPAM = "post_tweet(content='spam')"


def _polluter(entry_id: str) -> list[list[list[str]]]:
    """The gold answer, with a later turn that posts without mentions and then mentions someone on it."""
    entry = get_entry(entry_id)
    env = BfclEnvironment(entry)
    for turn in entry.ground_truth:
        env.execute_step(list(turn))
    tweet_id = json.loads(env.execute(SPAM))["id"]
    turns = [[list(t)] for t in entry.ground_truth]
    turns[-1].append(["exit_now()", SPAM, f"mention(tweet_id={tweet_id}, mentioned_usernames=['@eve'])"])
    return turns


def _explicit_empty_mentions(entry_id: str) -> list[list[list[str]]]:
    """The gold answer with `mentions=[]` spelled out: the same call, unless the default list was polluted."""
    return [[[c.replace("post_tweet(", "post_tweet(mentions=[], ", 1) if c.startswith("post_tweet(") else c
              for c in turn]] for turn in get_entry(entry_id).ground_truth]


def test_an_entry_scores_the_same_after_another_mutated_a_default(monkeypatch):
    victim, polluter = "multi_turn_base_11", "multi_turn_base_30"
    alone = score_entry(get_entry(victim), _explicit_empty_mentions(victim))
    assert alone.valid
    score_entry(get_entry(polluter), _polluter(polluter))
    after = score_entry(get_entry(victim), _explicit_empty_mentions(victim))
    assert (after.valid, after.error_type, after.partial_credit) == (alone.valid, alone.error_type,
                                                                     alone.partial_credit)
    # The trap is real: with the defaults shared process-wide (bfcl-eval's behaviour) the verdict flips.
    fn = env_class("TwitterAPI").post_tweet
    pristine_defaults("TwitterAPI")
    saved = fn.__defaults__
    monkeypatch.setattr("rcgrpo_tasks.env.multi_turn.environment.DefaultsScope.call",
                        lambda self, c, m, bound, args, kwargs: bound(*args, **kwargs))
    try:
        fn.__defaults__ = ([], [])
        score_entry(get_entry(polluter), _polluter(polluter))
        assert fn.__defaults__[1] == ["@eve"]
        assert not score_entry(get_entry(victim), _explicit_empty_mentions(victim)).valid
    finally:
        fn.__defaults__ = saved
    assert saved == ([], [])


SCRIPT = """
import json, sys
sys.path.insert(0, "tests")
from helpers import get_entry
from rcgrpo_tasks.env.multi_turn.scoring import score_entry
out = []
for entry_id, turns in json.loads(sys.stdin.read()):
    s = score_entry(get_entry(entry_id), turns)
    out.append([entry_id, s.valid, s.error_type, s.partial_credit, s.paper_reward])
print(json.dumps(out))
"""


def _score(items: list) -> list:
    out = subprocess.run([sys.executable, "-c", SCRIPT], input=json.dumps(items), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_verdicts_in_any_order_equal_verdicts_each_in_a_fresh_process():
    twitter = [e for e in ("multi_turn_base_5", "multi_turn_base_8", "multi_turn_base_11", "multi_turn_base_30",
                           "multi_turn_base_58", "multi_turn_base_65")]
    items = []
    for eid in twitter:
        items += [[eid, _polluter(eid)], [eid, _explicit_empty_mentions(eid)],
                  [eid, [[list(t)] for t in get_entry(eid).ground_truth]]]
    isolated = {json.dumps(item): _score([item])[0] for item in items}  # one fresh process per scoring
    for seed in (0, 1):
        order = items[:]
        random.Random(seed).shuffle(order)
        in_one_process = _score(order)
        assert in_one_process == [isolated[json.dumps(item)] for item in order]
