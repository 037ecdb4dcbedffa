"""What a conversion owns in its output folder, and the guard that decides whether a run may write there.

Data safety rules (the converter, `index` and `merge` share them):
- fastpipe deletes only files its own records say it wrote: the shards and indexes listed in a manifest or the
  progress journal, the previews, rejection lists and other readers' files (readers.py) a manifest names, and its
  own temporary files;
- a folder holding other work (another conversion, shards adopted with `fastpipe index`, an unreadable manifest) is
  replaced only with --overwrite, and then only the files above go;
- files fastpipe did not write but would overwrite (a foreign `train-000000.tar` or `_info.json`) stop the run,
  named (`index` keeps a reader file of the user's instead: it describes their own shards).
"""

from __future__ import annotations

import re
from pathlib import Path

from fastpipe.dataset.manifest import ManifestError, from_dict
from fastpipe.errors import ConfigError
from fastpipe.util import parse_json, read_json


def shard_pattern(prefix: str) -> re.Pattern:
    """Names ShardWriter gives the shards of `prefix` (e.g. train, or train-003 for part 3)."""
    return re.compile(rf"{re.escape(prefix)}-\d{{6}}\.(tar|idx)")


def read_manifest(path: Path):
    """(manifest or None, problem): an unreadable or damaged manifest is reported, never trusted."""
    if not path.exists():
        return None, None
    try:
        return from_dict(read_json(path), path.parent), None
    except (OSError, ValueError, ManifestError) as e:
        return None, f"{path.name} is unreadable ({type(e).__name__})"


def manifest_files(m) -> set[Path]:
    """Files a manifest says fastpipe wrote: for adopted shards the indexes only, the tars are the user's."""
    files = set()
    for sp in m.splits.values():
        for s in sp.shards:
            files.add(m.root / s.index)
            if not m.foreign:
                files.add(m.root / s.path)
    files |= {m.root / p for p in m.outputs.get("previews", {}).values()}
    if "rejected" in m.outputs:
        files.add(m.root / m.outputs["rejected"])
    if "near_duplicates" in m.outputs:
        near = m.outputs["near_duplicates"]
        files |= {m.root / near[k] for k in ("file", "preview", "fingerprints") if k in near}
    return files | {m.root / p for p in m.outputs.get("readers", [])}


def journal_files(journal_path: Path) -> set[Path]:
    files = set()
    if not journal_path.exists():
        return files
    for line in journal_path.read_text().splitlines()[1:]:
        try:
            shard = parse_json(line).get("shard")
        except ValueError:
            break
        if shard:
            files |= {journal_path.parent / shard["path"], journal_path.parent / shard["index"]}
    return files


def temporary_files(out: Path, prefixes: list[str]) -> set[Path]:
    """Half-written shards of ours (ShardWriter's `.tmp` names) and atomic-write leftovers (`.NAME.tmpPID`)."""
    pats = [shard_pattern(p) for p in prefixes]
    found = {p for p in out.glob("*.tar.tmp") if any(r.fullmatch(p.name[:-4]) for r in pats)}
    return found | set(out.glob(".*.tmp[0-9]*"))


def foreign_conflicts(out: Path, prefixes: list[str], owned: set[Path], names: list[str] = ()) -> list[Path]:
    """Files with the names this run writes (its shards, and `names`) that no record of ours lists."""
    pats = [shard_pattern(p) for p in prefixes]
    return sorted(p for p in out.iterdir() if (any(r.fullmatch(p.name) for r in pats) or p.name in names)
                  and p not in owned)


def remove(paths: set[Path]) -> None:
    for p in sorted(paths, reverse=True):
        p.unlink(missing_ok=True)
    for folder in {p.parent for p in paths if p.parent.name == "previews"}:
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def refuse_conflicts(out: Path, conflicts: list[Path]) -> None:
    if conflicts:
        names = ", ".join(p.name for p in conflicts[:5]) + (" ..." if len(conflicts) > 5 else "")
        raise ConfigError(f"{out} holds {len(conflicts)} file(s) fastpipe did not write but would overwrite "
                          f"({names}); choose another OUT folder or move them away (--overwrite never deletes "
                          f"files fastpipe did not write)")
