"""Isolated environments: fresh state per rollout, bfcl-eval's observation strings, no leaks."""

import gc
import json
import tracemalloc

from helpers import get_entry

from rcgrpo_tasks.env.multi_turn.entries import load_entries
from rcgrpo_tasks.env.multi_turn.environment import BfclEnvironment


def test_two_environments_of_one_entry_do_not_share_state():
    e = get_entry("multi_turn_base_0")
    a, b = BfclEnvironment(e), BfclEnvironment(e)
    before = json.dumps(b.state(), default=str, sort_keys=True)
    gold = [c for turn in e.ground_truth for c in turn]
    a.execute_step(gold)
    assert json.dumps(a.state(), default=str, sort_keys=True) != before
    assert json.dumps(b.state(), default=str, sort_keys=True) == before
    assert json.dumps(BfclEnvironment(e).state(), default=str, sort_keys=True) == before


def test_observations_match_bfcl_eval_strings():
    e = get_entry("multi_turn_base_0")
    env = BfclEnvironment(e)
    assert env.execute("nonexistent_tool(x=1)") == "Error during execution: name 'nonexistent_tool' is not defined"
    assert env.execute("kill()") == "Error during execution: Function call kill is not allowed."
    out = env.execute("ls()")
    assert json.loads(out)  # dict results are JSON, as bfcl-eval's json.dumps
    assert env.execute("cd(folder=1, bogus=2)").startswith("Error during execution: ")
    assert env.execute("cd(folder=os.getcwd())").startswith("Error during execution: ")


def test_withheld_miss_func_function_still_executes():
    e = next(x for x in load_entries(["miss_func"]) if x.missed_function)
    env = BfclEnvironment(e)
    held = [n for names in e.missed_function.values() for n in names]
    assert set(held) <= env.function_names


def test_memory_does_not_grow_over_1000_builds():
    entries = load_entries(["base"])[:50]
    for e in entries:  # warm caches (class imports, method tables)
        BfclEnvironment(e).execute_step([c for t in e.ground_truth for c in t])
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    for i in range(1000):
        e = entries[i % len(entries)]
        BfclEnvironment(e).execute_step(list(e.ground_truth[0]))
    gc.collect()
    after, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert after - base < 2_000_000, f"grew {after - base} bytes over 1000 environments"
