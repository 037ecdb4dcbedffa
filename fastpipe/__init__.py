"""fastpipe: shard image data once, load it fast, train with predictable GPU memory, find the bottleneck."""

__version__ = "0.1.0"
