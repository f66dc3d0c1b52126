"""Counts and differences of the harness's modes, from pytest's JUnit XML of each run.

    python tests/trl_suite/compare.py OUT_DIR [--modes baseline none rc] [--json OUT_DIR/outcomes.json]

Reads OUT_DIR/<mode>.xml and any OUT_DIR/<mode>-<n>.xml (a mode run in parts: a later part's outcome of a test
replaces an earlier one's; a test a Ctrl-C stopped counts as not run); prints per mode collected / passed / failed / skipped (an error counts as failed, an
xfail as skipped) and the seconds its tests took, then, for every mode but the baseline, the tests that pass in the baseline and not in that mode,
each with the first line of its failure message. Exit status 1 when `none` misses any test the baseline passes
(the goal: 100 % of the baseline's passing tests pass under `conditioning="none"`), else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUTCOMES = ("passed", "failed", "skipped")


def outcomes(xml: Path, seconds: list[float] | None = None) -> dict[str, tuple[str, str]]:
    """`{test id: (outcome, first message line)}` of one JUnit XML file; each test's seconds appended to
    `seconds`."""
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        texts = " ".join((child.get("message") or "") + (child.text or "") for child in case)
        if case.get("name") is None or "KeyboardInterrupt" in texts:
            continue  # a part stopped with Ctrl-C: its test in flight did not run to an outcome
        if seconds is not None:
            seconds.append(float(case.get("time") or 0.0))
        test = f"{case.get('classname', '')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", child.get("message") or (child.text or "")
                break
            if child.tag == "skipped":
                outcome, message = "skipped", child.get("message") or ""
        result[test] = (outcome, message.strip().splitlines()[0][:300] if message.strip() else "")
    return result


def counts(results: dict[str, tuple[str, str]]) -> dict[str, int]:
    tally = {"collected": len(results), **{o: 0 for o in OUTCOMES}}
    for outcome, _ in results.values():
        tally[outcome] += 1
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--modes", nargs="+", default=["baseline", "none", "rc"])
    parser.add_argument("--json", type=Path, default=None, help="write every test's outcome per mode here")
    args = parser.parse_args(argv)
    runs, seconds = {}, {}
    for mode in args.modes:
        parts = sorted(args.out.glob(f"{mode}-*.xml"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        files = [p for p in [args.out / f"{mode}.xml", *parts] if p.exists()]
        if files:
            runs[mode], seconds[mode] = {}, {}
            for xml in files:
                times: list[float] = []
                part = outcomes(xml, times)
                seconds[mode].update(zip(part, times))
                runs[mode].update(part)
    if not runs:
        print(f"no <mode>.xml in {args.out}", file=sys.stderr)
        return 2
    print(f"{'mode':<10}" + "".join(f"{k:>11}" for k in ("collected", *OUTCOMES, "test s")))
    for mode, results in runs.items():
        print(f"{mode:<10}" + "".join(f"{v:>11}" for v in counts(results).values())
              + f"{sum(seconds[mode].values()):>11.0f}")
    status = 0
    base = runs.get("baseline")
    for mode, results in runs.items():
        if base is None or mode == "baseline":
            continue
        missed = [t for t, (o, _) in base.items() if o == "passed" and results.get(t, ("absent", ""))[0] != "passed"]
        passing = sum(o == "passed" for o, _ in base.values())
        print(f"\n{mode}: {passing - len(missed)} of the baseline's {passing} passing tests pass; not passing:")
        for test in missed:
            outcome, message = results.get(test, ("absent", ""))
            print(f"  {outcome:<8} {test}\n           {message}")
        if mode == "none" and missed:
            status = 1
    if args.json:
        args.json.write_text(json.dumps({m: {t: o for t, (o, _) in r.items()} for m, r in runs.items()}, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
