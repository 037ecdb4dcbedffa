"""Per-sample randomness: each sample's crop and flip derive from (seed, epoch, position in the epoch's sequence)
alone, so they do not depend on which rank or worker decodes it, and a resumed run repeats them exactly.

A numpy Generator per sample costs ~30 us to create; this splitmix64 stream costs ~1 us per draw, which keeps the
per-sample machinery small (benchmarks/bench_loaders.py). Statistical quality is splitmix64's (it passes BigCrush),
more than augmentation needs.
"""

from __future__ import annotations

_M = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _M
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _M
    return z ^ (z >> 31)


class SampleRng:
    """The subset of numpy.random.Generator that augmentation uses: random, uniform, integers."""

    __slots__ = ("_s",)

    def __init__(self, *key: int):
        s = _GAMMA
        for k in key:
            s = _mix(((s ^ (int(k) & _M)) + _GAMMA) & _M)
        self._s = s

    def random(self) -> float:
        self._s = (self._s + _GAMMA) & _M
        return (_mix(self._s) >> 11) * (1.0 / (1 << 53))

    def uniform(self, low: float = 0.0, high: float = 1.0) -> float:
        return low + (high - low) * self.random()

    def integers(self, low: int, high: int) -> int:
        """An integer in [low, high)."""
        return low + min(int(self.random() * (high - low)), high - low - 1)
