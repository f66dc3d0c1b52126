"""The `rcgrpo` console script: the hash seed it fixes so stage outputs are byte-reproducible."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# A stand-in command registered under `probe`: prints the seed the process runs with and a str hash.
PROBE = textwrap.dedent("""
    import os, sys, types
    from rcgrpo_tasks import cli
    probe = types.ModuleType("probe_cmd")
    def app(args, prog_name, standalone_mode):
        print(os.environ.get("PYTHONHASHSEED"), hash("travel_class"), {"economy", "first", "business"})
    probe.app = app
    sys.modules["probe_cmd"] = probe
    cli.COMMANDS["probe"] = ("probe_cmd", "test probe")
    sys.exit(cli.main())
""")


def _run(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "DVC_STAGE")} | extra_env
    out = subprocess.run([sys.executable, "-c", PROBE, "probe"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_console_script_runs_every_command_with_hash_seed_zero():
    first, second = _run({}), _run({})
    assert first.split()[0] == "0"
    assert first == second  # same set order and str hash in two fresh processes


def test_an_explicit_hash_seed_is_respected():
    assert _run({"PYTHONHASHSEED": "123"}).split()[0] == "123"


def test_in_process_main_does_not_reexec(monkeypatch, capsys):
    from rcgrpo_tasks import cli
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert cli.main(["--help"]) == 0  # would replace pytest if it exec'd
    assert "Usage: rcgrpo" in capsys.readouterr().out
