"""Safe call parsing: literals only, nothing executed, clear errors."""

import builtins

import pytest

from rcgrpo_tasks.env.multi_turn.calls import Call, CallParseError, format_calls, parse_call_string, parse_calls


def test_parses_bfcl_call_list_with_literals():
    r = parse_calls("[cd(folder='doc'), mv(source='a.txt', destination='b'), ls(a=True), f(1, -2.5, x=[1, {'k': (None,)}])]")
    assert r.ok and [c.name for c in r.calls] == ["cd", "mv", "ls", "f"]
    assert r.calls[3].args == (1, -2.5) and r.calls[3].kwargs == {"x": [1, {"k": (None,)}]}


@pytest.mark.parametrize("text", [
    "```python\n[cd(folder='doc')]\n```",
    "Sure! Here you go: [cd(folder='doc')] Hope that helps.",
    "cd(folder='doc')",
    "```\ncd(folder='doc')\n```",
    "I will call cd(folder='doc') now.",
])
def test_tolerates_fences_and_prose(text):
    r = parse_calls(text)
    assert [c.to_string() for c in r.calls] == ["cd(folder='doc')"]


def test_prose_without_calls_yields_nothing():
    r = parse_calls("I cannot help with that, the file does not exist.")
    assert r.calls == [] and r.errors == []


@pytest.mark.parametrize("text,needle", [
    ("[os.system('touch /tmp/x')]", "bare function names"),
    ("[__import__('os')]", "dunder"),
    ("[f(x=__import__('os').system('id'))]", "not a literal"),
    ("[f(x=y)]", "not a literal"),
    ("[f(x=g())]", "not a literal"),
    ("[f(x=(lambda: 1)())]", "not a literal"),
    ("[f(x=[i for i in range(10)])]", "not a literal"),
    ("[f(x=f'{1}')]", "not a literal"),
    ("[f(*[1, 2])]", "starred"),
    ("[f(**{'a': 1})]", "**kwargs"),
    ("[f(x=" + "[" * 40 + "]" * 40 + ")]", "nested deeper"),
    ("[f(x='" + "a" * 15000 + "')]", "longer than"),
    ("[f(x=" + "9" * 200 + ")]", "digits"),
    ("[f(x=1+2)]", "not a literal"),
    ("[f(x=b'abc')]", "bytes"),
])
def test_rejects_non_literals_with_clear_error(text, needle):
    r = parse_calls(text)
    assert r.calls == [] or all(c.name != "system" for c in r.calls)
    assert any(needle in e for e in r.errors), r.errors
    with pytest.raises(CallParseError):
        parse_call_string(text[1:-1])


def test_adversarial_strings_execute_nothing(monkeypatch, tmp_path):
    """Plant side effects that any evaluation of the text would trigger; none may happen."""
    from helpers import get_entry

    from rcgrpo_tasks.env.multi_turn.environment import BfclEnvironment

    marker = tmp_path / "pwned"
    fired = []
    monkeypatch.setattr(builtins, "rcgrpo_side_effect", lambda *a, **k: fired.append(a), raising=False)
    payloads = [
        f"[open('{marker}', 'w').write('x')]",
        f"[f(x=open('{marker}', 'w'))]",
        f"[f(x=__import__('pathlib').Path('{marker}').touch())]",
        "[cd(folder=rcgrpo_side_effect())]",
        "[rcgrpo_side_effect()]",
        "[exec('rcgrpo_side_effect()')]",
        "[eval('rcgrpo_side_effect()')]",
        "[ls.__globals__]",
    ]
    env = BfclEnvironment(get_entry("multi_turn_base_0"))
    for text in payloads:
        r = parse_calls(text)
        for c in r.calls:  # bare-name calls with literal args are data, e.g. eval('...') -> Call('eval', ...)
            obs = env.execute(c)
            assert obs.startswith("Error during execution: "), obs
        for s in text[1:-1].split(", "):
            assert env.execute(s).startswith("Error during execution: ")
    assert not marker.exists() and fired == []


def test_canonical_string_round_trips():
    c = Call("mv", ("a",), {"destination": "b", "n": [1, 2]})
    assert parse_call_string(c.to_string()) == c
    assert format_calls([c, Call("ls")]) == "[mv('a', destination='b', n=[1, 2]), ls()]"


def test_oversized_call_list_rejected():
    r = parse_calls("[" + ", ".join("f(x=1)" for _ in range(2000)) + "]")
    assert r.calls == [] and any("more than" in e for e in r.errors)
