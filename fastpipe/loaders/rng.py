"""Per-sample randomness: each sample's crop and flip derive from (seed, epoch, position in the epoch's sequence)
alone, so they do not depend on which rank or worker decodes it, and a resumed run repeats them exactly.

A numpy Generator per sample is costly to create; this splitmix64 stream is a few integer operations per draw,
and `SampleRng.batch` computes a whole batch's streams and their first draws with numpy at once (the same
numbers; benchmarks/profile_worker.py shows the draws' share of a worker's time). Statistical quality is
splitmix64's (it passes BigCrush), more than augmentation needs.
"""

from __future__ import annotations

import functools

import numpy as np

_M = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _M
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _M
    return z ^ (z >> 31)


def _mix_np(z: np.ndarray) -> np.ndarray:
    """_mix on uint64 arrays (numpy's uint64 arithmetic wraps modulo 2**64, as `& _M` does)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _state(key) -> int:
    s = _GAMMA
    for k in key:
        s = _mix(((s ^ (int(k) & _M)) + _GAMMA) & _M)
    return s


class SampleRng:
    """The subset of numpy.random.Generator that augmentation uses: random, uniform, integers."""

    __slots__ = ("_ready", "_s")

    def __init__(self, *key: int):
        self._s, self._ready = _state(key), None

    @staticmethod
    def states(key: tuple[int, ...], positions) -> np.ndarray:
        """The state each SampleRng(*key, p) starts from, as uint64 (the crop decoder's C path derives them itself
        from key_state(key): jpegcrop.train_chunk)."""
        with np.errstate(over="ignore"):
            return _mix_np((np.uint64(SampleRng.key_state(key)) ^ np.asarray(positions).astype(np.uint64))
                           + np.uint64(_GAMMA))

    @staticmethod
    @functools.lru_cache(maxsize=64)  # a batch's (seed, epoch): once an epoch, not once a batch
    def key_state(key: tuple[int, ...]) -> int:
        """The state of the key alone, before a position is mixed in."""
        return _state(key)

    @classmethod
    def at(cls, state) -> SampleRng:
        """The generator whose state is `state` (one of `states`): the same numbers as SampleRng(*key, p)."""
        r = cls.__new__(cls)
        r._s, r._ready = int(state), None
        return r

    @classmethod
    def batch(cls, key: tuple[int, ...], positions: np.ndarray, draws: int = 8) -> list[SampleRng]:
        """[SampleRng(*key, p) for p in positions], each with its first `draws` numbers computed at once."""
        s = cls.states(key, positions)
        with np.errstate(over="ignore"):
            steps = s[:, None] + np.arange(1, draws + 1, dtype=np.uint64) * np.uint64(_GAMMA)
            values = (_mix_np(steps) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
        out = []
        for state, row in zip(steps[:, -1].tolist(), values[:, ::-1].tolist()):
            r = cls.__new__(cls)
            r._s, r._ready = state, row  # reversed: pop() hands them out in order
            out.append(r)
        return out

    def random(self) -> float:
        if self._ready:
            return self._ready.pop()
        self._s = (self._s + _GAMMA) & _M
        return (_mix(self._s) >> 11) * (1.0 / (1 << 53))

    def uniform(self, low: float = 0.0, high: float = 1.0) -> float:
        return low + (high - low) * self.random()

    def integers(self, low: int, high: int) -> int:
        """An integer in [low, high)."""
        return low + min(int(self.random() * (high - low)), high - low - 1)
