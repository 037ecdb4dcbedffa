"""fastpipe: shard image data once, load it fast, train with predictable GPU memory, find the bottleneck."""

__version__ = "0.1.0"


def make_loader(out, backend: str = "torch", **settings):
    """See fastpipe.loaders.make_loader (imported lazily: `import fastpipe` stays light for the converter)."""
    from fastpipe.loaders import make_loader as _make

    return _make(out, backend, **settings)


def watch(iterable, every: int | None = None, writer=None, warmup: int = 20, log=None, trace_memory: bool = False):
    """Is the loader or the device holding your loop back? See fastpipe.bench.watch (imported on first use)."""
    from fastpipe.bench.watch import watch as _watch

    return _watch(iterable, every, writer, warmup, log, trace_memory)


def __getattr__(name: str):
    """fastpipe.Predictor (fastpipe.predict.predictor), imported on first use: it needs torch."""
    if name == "Predictor":
        from fastpipe.predict.predictor import Predictor

        return Predictor
    raise AttributeError(f"module 'fastpipe' has no attribute {name!r}")
