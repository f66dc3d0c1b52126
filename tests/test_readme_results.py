"""README's Results say only what the results files say: every table in the section is a verbatim copy of a
table in a committed results file, and every decimal number its prose states (a rate, an interval end, a p)
appears in one of those files; run times name their own source (docs/log.md)."""

from __future__ import annotations

import re

from helpers import REPO_ROOT

SOURCES = ("results/report/table.md", "results/study/table.md", "results/dev-sweep/rctp-design/table.md",
           "results/dev-sweep/rctp-content/table.md", "results/dev-sweep/rctp-content/wrong_call-s0.json",
           "results/dev-sweep/rctp-content/wrong_call-s1.json", "results/dev-sweep/rctp-content/wrong_call-s2.json")
"""The files README's Results quote: the default's report, the study's, RCTP's design tables on dev (the content
design's per-seed records beside its table)."""
NUMBER = re.compile(r"(?<![\w.])[+-]?\d+\.\d+")


def _section() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index("\n## Results\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def _sources() -> str:
    return "\n".join((REPO_ROOT / p).read_text() for p in SOURCES)


def test_every_results_table_is_a_results_file_s():
    tables, block = [], []
    for line in _section().splitlines() + [""]:
        if line.startswith("|"):
            block.append(line)
        elif block:
            tables.append("\n".join(block))
            block = []
    assert tables, "README's Results hold no table"
    sources = _sources()
    missing = [t.splitlines()[0] for t in tables if t not in sources]
    assert not missing, f"tables not found verbatim in {SOURCES}: {missing}"


def test_every_number_in_the_results_prose_comes_from_a_results_file():
    sources = _sources()
    prose = "\n".join(line for line in _section().splitlines() if not line.startswith("|"))
    prose = re.sub(r"`[^`]*`|\([^()]*docs/log\.md[^()]*\)", "", prose)  # commands; timings cite the log
    missing = sorted({n.lstrip("+") for n in NUMBER.findall(prose)} - {n.lstrip("+") for n in NUMBER.findall(sources)})
    assert not missing, f"numbers in README's Results prose found in no results file: {missing}"
