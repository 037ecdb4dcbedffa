"""Near-copies in the plan: photos that are one picture (dataset/nearcopy.py) are found before the split, so that a
group never straddles train and val. A group under two labels is recorded as a label conflict, not refused as exact
copies are: a defect photo and its defect-free neighbour can differ only in a region too small for a fingerprint of
the whole picture, and both are right.

`--near-duplicates`:
- group (the default): every photo kept, each group assigned to one split whole; with the split given by SRC
  (train/ and val/ folders), the groups that straddle it are reported;
- drop-from-val: as group, and the val copies of a group that straddles SRC's split are rejected;
- drop: one photo per group of one label kept (the original: sources.original_first), the others rejected;
- off: no fingerprints, no groups.
Everything here is deterministic, so that every part of a cluster job and every rerun plans alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastpipe.convert.sources import Item, Rejection, original_first
from fastpipe.dataset import nearcopy

MODES = ("group", "drop-from-val", "drop", "off")


@dataclass
class Group:
    items: list[Item]  # the original first (sources.original_first), then in path order
    distance: dict[str, int]  # each photo's distance in bits to the closest other photo of the group

    def labels(self) -> list[str]:
        return sorted({i.label for i in self.items})

    def straddles(self) -> bool:
        return len({i.split for i in self.items}) > 1

    def record(self, split_of: dict[str, str]) -> dict:
        return {"photos": [{"path": i.path, "label": i.label, "split": split_of.get(i.path),
                            "distance": self.distance[i.path]} for i in self.items],
                "straddles": len({split_of.get(i.path) for i in self.items}) > 1,
                "label_conflict": len(self.labels()) > 1}


def find(items: list[Item], fps: dict[str, np.ndarray], threshold: int) -> list[Group]:
    """The groups of near-copies among the items that have a fingerprint."""
    have = [i for i in sorted(items, key=lambda i: i.path) if i.path in fps]
    if len(have) < 2:
        return []
    near = nearcopy.pairs(np.stack([fps[i.path] for i in have]), threshold)
    closest: dict[int, int] = {}
    for a, b, d in near:
        closest[a], closest[b] = min(closest.get(a, 256), d), min(closest.get(b, 256), d)
    out = []
    for members in nearcopy.groups(len(have), near):
        group = sorted((have[k] for k in members), key=lambda i: original_first(i.path))
        out.append(Group(group, {have[k].path: closest[k] for k in members}))
    return out


def resolve(items: list[Item], groups: list[Group], mode: str) -> tuple[list[Item], list[Group], list[Rejection]]:
    """(the items kept, the groups among them, the rejections): `drop` keeps the original of each group of one
    label; `drop-from-val` rejects the val copies of a group that straddles SRC's split."""
    rejected: list[Rejection] = []
    kept_groups = []
    for g in groups:
        if mode == "drop" and len(g.labels()) == 1:
            rejected += [Rejection(i.path, "near-duplicate", f"in a group of near-copies with {g.items[0].path}, "
                                                             f"which is kept ({g.distance[i.path]} bits from the "
                                                             f"closest of the group)")
                         for i in g.items[1:]]
        elif mode == "drop-from-val" and g.straddles():
            train = next(i.path for i in g.items if i.split == "train")
            rejected += [Rejection(i.path, "near-duplicate", f"in val, a near-copy of {train} in train (differs in "
                                                             f"{g.distance[i.path]} bits): removed from val")
                         for i in g.items if i.split == "val"]
            left = [i for i in g.items if i.split != "val"]
            if len(left) > 1:
                kept_groups.append(Group(left, {i.path: g.distance[i.path] for i in left}))
        else:
            kept_groups.append(g)
    refused = {r.path for r in rejected}
    return [i for i in items if i.path not in refused], kept_groups, rejected


def units(items: list[Item], groups: list[Group]) -> list[list[Item]]:
    """The items as the split assigns them: each group one unit, every other item alone; in path order."""
    grouped = {i.path: k for k, g in enumerate(groups) for i in g.items}
    out, seen = [], set()
    for i in sorted(items, key=lambda i: i.path):
        k = grouped.get(i.path)
        if k is None:
            out.append([i])
        elif k not in seen:
            seen.add(k)
            out.append(sorted(groups[k].items, key=lambda i: i.path))
    return out
