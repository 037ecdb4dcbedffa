"""The process group of a run under torchrun: started from torchrun's environment, ended with the run."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

from fastpipe.errors import FastpipeError
from fastpipe.train.loop import Dist, TrainingStopped


def setup_distributed(device: str | None) -> tuple[Dist, torch.device]:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK: then NCCL on GPUs, gloo on CPU. Else a single process."""
    if "RANK" not in os.environ or dist.is_initialized():
        d = Dist(dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else Dist()
        return d, torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    local = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), local), torch.device(f"cuda:{local}" if use_cuda else "cpu")


@contextmanager
def distributed(device: str | None):
    """(Dist, device) for the run; a process group started here is destroyed when the run ends or stops cleanly.
    Left to the interpreter's exit, gloo's threads still held tensors there and the process aborted (SIGABRT) after
    training had finished, so torchrun reported the job failed. After an unexpected error NCCL's group is left
    alone, since another rank may still be inside a collective; gloo's is always destroyed."""
    ours = "RANK" in os.environ and not dist.is_initialized()
    d, dev = setup_distributed(device)
    clean = False
    try:
        yield d, dev
        clean = True
    except (TrainingStopped, FastpipeError):
        clean = True
        raise
    finally:
        if ours and dist.is_initialized() and (clean or dist.get_backend() == "gloo"):
            dist.destroy_process_group()
