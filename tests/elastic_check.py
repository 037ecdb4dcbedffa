"""Run by test_loaders.py: one phase of an elastic resume, under torchrun (gloo) or as a single process.

    elastic_check.py OUT PHASE_DIR stop|resume WORKERS [BATCHES]
stop: iterate BATCHES batches per rank, write this rank's keys and (rank 0) the loader state.
resume: load the state, iterate the rest of the epoch, write this rank's keys.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from fastpipe import make_loader


def main(out: str, folder: str, phase: str, workers: int, batches: int = 0) -> None:
    ranked = "RANK" in __import__("os").environ
    if ranked:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if ranked else 0
    loader = make_loader(out, "torch", batch_size=4, image_size=32, device="cpu", num_workers=workers, seed=3,
                         with_keys=True)
    folder = Path(folder)
    if phase == "resume":
        loader.load_state_dict(json.loads((folder / "state.json").read_text()))
    else:
        loader.set_epoch(2)
    keys = []
    for i, (_x, _y, k) in enumerate(loader):
        keys += [str(s) for s in k]
        if phase == "stop" and i + 1 == batches:
            break
    (folder / f"{phase}-{rank}.json").write_text(json.dumps(keys))
    if phase == "stop" and rank == 0:
        (folder / "state.json").write_text(json.dumps(loader.state_dict()))
    if ranked:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *(int(x) for x in sys.argv[5:]))
