"""Run by test_loaders.py under `torchrun --nproc_per_node 2`: gloo on CPU, uneven shards, no hang."""

import sys

import torch
import torch.distributed as dist

from fastpipe import make_loader
from fastpipe.dataset.loading import load


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kw = dict(batch_size=4, image_size=32, device="cpu", num_workers=2)
    train = make_loader(out, split="train", **kw)  # rank and world size come from torch.distributed
    assert (train.cfg.rank, train.cfg.world_size) == (rank, world)
    for epoch in range(2):
        train.set_epoch(epoch)
        n = 0
        for _x, _y in train:
            dist.all_reduce(torch.ones(1))  # a collective per step, as DDP's gradient sync: hangs if counts differ
            n += 1
        assert n == len(train)
    val = make_loader(out, split="val", **kw)
    seen = torch.zeros(1)
    for _x, y in val:
        dist.all_reduce(torch.ones(1))
        seen += len(y)
    dist.all_reduce(seen)
    expected = load(out).splits["val"].samples
    assert int(seen.item()) == expected, (seen, expected)
    if rank == 0:
        print("DDP-OK", len(train), int(seen.item()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
