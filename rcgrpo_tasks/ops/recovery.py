"""What a killed stage left, cleared by whatever starts next in the checkout: `recover` sweeps the run folder
(`ops.rundir.sweep`: locks and process markers no live process holds, and the half-written temps they list)
and, when a stage process was among the dead, ends its MLflow runs KILLED with the reason
(`tracking.reap_orphans`). The `rcgrpo` entry point calls it before every command, the Prefect flow and
`rcgrpo run-plan` before their first stage; the pipeline's root stage (`rcgrpo check-params`) is changed in
DVC's eyes while a dead marker lies there, so the next `dvc repro` runs it even when the cut stage itself is
then restored from DVC's run cache.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rcgrpo_tasks.ops import rundir, tracking


def recover(start: str | Path, by: str, echo=None, reap: bool = False) -> dict[str, list]:
    """Sweep the run folder of the checkout holding `start` and end the dead stage runs; {swept: [...],
    reaped: [run ids]} (both empty outside a checkout with a run folder, or when nothing was left). `by`
    names who did it (in the closed runs' `rcgrpo.error`); `echo` (default: stderr) gets one line when
    anything was cleared. `reap`: look for RUNNING runs of dead processes even when no stage marker was found
    (the flow, before its parent run opens)."""
    run = rundir.find(start)
    swept = rundir.sweep(run) if run is not None else []
    reaped: list[str] = []
    if reap or any(s.kind == "process" for s in swept):  # MLflow is imported only when there may be runs to end
        reaped = tracking.reap_orphans(closed_by=f"{by} (pid {os.getpid()})")
    if swept:
        stages = sorted({s.holder for s in swept if s.kind == "process"})
        line = (f"recovered after a killed process: {len(swept)} stale lock(s)/marker(s) swept in {run}, "
                f"{sum(len(s.removed) for s in swept)} half-written temp(s) removed, {len(reaped)} MLflow run(s) "
                f"ended KILLED" + (f" (dead: {'; '.join(stages)[:500]})" if stages else ""))
        (echo or (lambda text: print(text, file=sys.stderr)))(line)
    return {"swept": swept, "reaped": reaped}
