"""What a process asked of the stores: requests, bytes and retries, for `loader.stats` and the benchmarks."""

from __future__ import annotations

import os
import threading


class Counters:
    """Requests, bytes and retries of this process since the last `take()` (a worker ships them with a batch).
    A forked worker starts from zero: its parent's counts are the parent's to report."""

    def __init__(self):
        self.lock, self.pid = threading.Lock(), os.getpid()
        self.requests = self.bytes = self.retries = 0

    def __getstate__(self):  # a new process counts from zero
        return {}

    def __setstate__(self, state):
        self.__init__()

    def _mine(self) -> None:
        if self.pid != os.getpid():
            self.__init__()

    def add(self, requests: int = 0, nbytes: int = 0, retries: int = 0) -> None:
        self._mine()
        with self.lock:
            self.requests += requests
            self.bytes += nbytes
            self.retries += retries

    def take(self) -> tuple[int, int, int]:
        self._mine()
        with self.lock:
            out = (self.requests, self.bytes, self.retries)
            self.requests = self.bytes = self.retries = 0
        return out


__all__ = ["Counters"]
