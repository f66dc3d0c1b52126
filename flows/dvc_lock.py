"""A stage's dvc.lock entry as what moves between machines: its outputs to and from the DVC remote, the entry
into another checkout's dvc.lock, and whether a checkout's entry still holds (flows/grid.py, flows/stage_flow.py).

Workers share nothing but git and the remote, so a stage's outputs travel by its lock entry: the hashes DVC
recorded for every output, `cache: false` ones (metrics, tables, plots) included. DVC's own run cache restores a
stage this way (`StageCache.restore`: a stage built from the entry with every output cached, its objects pulled,
checked out); there the entry is found by hashing the stage's dependencies, here the parent hands it over
(`stage_from_entry`). DVC's `push --run-cache` no longer uploads the objects of `cache: false` outputs, so both
directions go through `repo.cloud` for every output of the entry (`transfer`): uploads are whole objects (S3 puts
are atomic) and a directory's listing goes last (DVC's transfer), so a cut push leaves no half-written object, and
a directory whose listing is in the remote has every file there.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

LOCK = "dvc.lock"


class TransferError(RuntimeError):
    """Objects of a stage's outputs did not reach (or come from) the remote."""


def read_entries(root: str | Path) -> dict[str, dict]:
    """{stage: its dvc.lock entry} of `root`/dvc.lock ({} without one), as plain JSON values. Read as DVC reads
    it (YAML 1.2, `dvc.utils.serialize`): PyYAML's YAML 1.1 turns a param `off` into False, and an entry written
    back so no longer matches params.yaml."""
    from dvc.utils.serialize import load_yaml

    path = Path(root) / LOCK
    if not path.is_file():
        return {}
    return json.loads(json.dumps(dict((load_yaml(str(path)) or {}).get("stages") or {})))


def write_entries(root: str | Path, entries: dict[str, dict]) -> None:
    """Set `entries` ({stage: entry}) in `root`/dvc.lock, every other entry as it was, in DVC's own YAML
    (`dvc.utils.serialize`), written to a temporary file and renamed: a reader never sees half a lock."""
    from dvc.utils.serialize import dump_yaml, load_yaml

    path = Path(root) / LOCK
    data = load_yaml(str(path)) if path.is_file() else {"schema": "2.0", "stages": {}}
    data.setdefault("stages", {}).update(entries)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    dump_yaml(str(tmp), data)
    os.replace(tmp, path)


def outs_of(entry: dict) -> dict[str, str]:
    """{output path: its hash} of a lock entry: what two runs of a stage made alike or not."""
    return {o["path"]: o.get("md5") or json.dumps(o, sort_keys=True) for o in entry.get("outs") or []}


def covers(out: str, dep: str) -> bool:
    """Whether output path `out` and dependency path `dep` overlap (one inside the other, or equal)."""
    a, b = out.rstrip("/"), dep.rstrip("/")
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


@contextlib.contextmanager
def repo_at(root: str | Path, locked: bool = True) -> Iterator:
    """DVC's repo at `root`; `locked`: holding DVC's own lock (no other dvc command in the checkout meanwhile),
    which what moves outputs needs and what takes it itself (`repo.status`) must not."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo, repo.lock if locked else contextlib.nullcontext():
        yield repo


def stage_from_entry(repo, entry: dict, paths: list[str] | None = None):
    """A stage whose outputs are `entry`'s (those overlapping `paths`, if given), every one cached, filled with
    the entry's hashes: what DVC's run cache builds to restore a stage (`StageCache._create_stage`)."""
    from dvc.stage import PipelineStage, create_stage
    from dvc.stage.loader import StageLoader

    outs = [o for o in entry.get("outs") or [] if paths is None or any(covers(o["path"], p) for p in paths)]
    stage = create_stage(PipelineStage, repo=repo, path=os.path.join(repo.root_dir, "dvc.yaml"),
                         wdir=repo.root_dir, cmd=entry.get("cmd", ""), outs=[o["path"] for o in outs])
    StageLoader.fill_from_lock(stage, {**entry, "outs": outs, "deps": []})
    return stage


@contextlib.contextmanager
def copies(repo) -> Iterator[None]:
    """Checkouts as plain copies while inside: a `cache: false` output must look like a file git tracks (DVC
    does the same in its run cache: `StageCache._cache_type_copy`)."""
    saved = repo.cache.local.cache_types, repo.cache.legacy.cache_types
    repo.cache.local.cache_types = repo.cache.legacy.cache_types = ["copy"]
    try:
        yield
    finally:
        repo.cache.local.cache_types, repo.cache.legacy.cache_types = saved


def _filters(stage, paths: list[str] | None) -> list[tuple[object, str | None]]:
    """(output, the path inside it to move, or None: all of it) for the outputs of `stage` under `paths`."""
    found = []
    for out in stage.outs:
        inner = [p for p in (paths or []) if p.rstrip("/").startswith(str(out.def_path).rstrip("/") + "/")]
        found += [(out, os.path.join(stage.repo.root_dir, p)) for p in inner] or [(out, None)]
    return found


def _used(repo, stage, paths: list[str] | None, remote: str | None) -> set:
    objs: set = set()
    for out, inner in _filters(stage, paths):
        for ids in out.get_used_objs(filter_info=inner, remote=remote).values():
            objs |= set(ids)
    return objs


def push_entry(root: str | Path, entry: dict, remote: str, uncached_only: bool = False) -> int:
    """Upload every output of `entry` from `root` (its workspace and cache) to `remote`; `cache: false` outputs
    are first added to the cache (as copies). `uncached_only`: those alone (a parent pushing the records its
    checkout holds). Returns the objects sent; TransferError naming what failed."""
    with repo_at(root) as repo, copies(repo):
        uncached = {o.def_path for o in repo.index.outs if not o.use_cache}
        records = [o["path"] for o in entry.get("outs") or [] if o["path"] in uncached]
        for out in stage_from_entry(repo, entry, records).outs if records else []:
            out.commit()
        stage = stage_from_entry(repo, entry, records if uncached_only else None)
        if not stage.outs:
            return 0
        result = repo.cloud.push(_used(repo, stage, None, None), remote=remote)
    if result.failed:
        raise TransferError(f"{len(result.failed)} object(s) of {', '.join(str(o) for o in stage.outs)} not pushed "
                            f"to remote {remote!r}")
    return len(result.transferred)


def pull_entries(root: str | Path, entries: dict[str, dict], paths: list[str] | None, remote: str) -> int:
    """Download into `root` the outputs of `entries` ({stage: entry}) that overlap `paths` (None: all; a path
    inside a directory output: that part of it), and check them out as copies. Returns the objects fetched;
    TransferError naming what the remote lacks."""
    fetched = 0
    with repo_at(root) as repo, copies(repo):
        for name, entry in entries.items():
            stage = stage_from_entry(repo, entry, paths)
            if not stage.outs:
                continue
            result = repo.cloud.pull(_used(repo, stage, paths, remote), remote=remote)
            if result.failed:
                raise TransferError(f"{len(result.failed)} object(s) of {name}'s outputs not in remote {remote!r}")
            fetched += len(result.transferred)
            for out, inner in _filters(stage, paths):
                out.checkout(filter_info=inner, force=True)  # over what git checked out, as a run would write
    return fetched


def in_remote(root: str | Path, entry: dict, remote: str) -> list[str]:
    """The outputs of `entry` whose object (a file's, or a directory's listing, which DVC uploads after its
    files) the remote lacks; [] when all are there."""
    from dvc_data.hashfile.hash_info import HashInfo

    missing = []
    with repo_at(root, locked=False) as repo:
        for out in entry.get("outs") or []:
            info = HashInfo("md5", out.get("md5"))
            status = repo.cloud.status([info], remote=remote)
            if info not in status.ok | status.deleted:
                missing.append(out["path"])
    return missing


def stale_reasons(status: list, upstream_outs: list[str]) -> list[str]:
    """Why one stage's `dvc status` entry (`repo.status()[stage]`) makes it stale in a checkout that holds none
    of the pipeline's data: a changed command, a changed code or params dependency does; a dependency that is an
    upstream stage's output and the stage's own outputs do not (the entry and the remote are what holds them:
    `in_remote`; the checkout's copies of `cache: false` ones are restored from there)."""
    reasons = []
    for item in status:
        if isinstance(item, str):
            reasons.append(item)
            continue
        for kind, changes in item.items():
            for path, change in (changes or {}).items():
                if kind == "changed outs" or kind == "changed deps" and any(covers(o, path) for o in upstream_outs):
                    continue
                reasons.append(f"{kind}: {path} {change if isinstance(change, str) else 'modified'}")
    return reasons


def remote_url(root: str | Path, name: str) -> tuple[str, str | None]:
    """(url, S3 endpoint or None) of DVC remote `name` as `root`'s config resolves it."""
    with repo_at(root, locked=False) as repo:
        conf = repo.config["remote"][name]
    return str(conf["url"]), conf.get("endpointurl")
