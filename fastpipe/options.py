"""Declaring settings once: a config dataclass field carries its CLI help, flag and parser with its default.

    batch_size: int = opt(64, "images per device and step")

`fastpipe.cli` builds every subcommand's flags from these fields (flag = --field-name, kebab-case), so a
default or a help text exists in exactly one place. Parsers for values people type (sizes, worker counts) live
here too, and refuse what they cannot read with the fix.
"""

from __future__ import annotations

import re
from dataclasses import field

from fastpipe.errors import ConfigError

_UNITS = {"K": 1024, "KB": 1024, "M": 1024**2, "MB": 1024**2, "G": 1024**3, "GB": 1024**3, "T": 1024**4,
          "TB": 1024**4, "B": 1}


def opt(default, help: str, *, flag: str | None = None, parse=None, choices=None, positional: bool = False,
        nargs=None, cli: bool = True, sweep: bool = False):
    """A dataclass field with its command-line description. `cli=False` keeps a setting out of the CLI;
    `sweep=True` lets the CLI take comma-separated values (fastpipe bench runs each)."""
    meta = {"help": help, "flag": flag, "parse": parse, "choices": choices, "positional": positional,
            "nargs": nargs, "cli": cli, "sweep": sweep}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def parse_size(text, bare: str | None = None) -> int:
    """'256MB', '64k', '1.5G' → bytes (binary units). A bare number takes the unit `bare`, or is refused when
    None: `--gpu-memory 8` must not mean 8 bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = (m.group(2).upper().replace("IB", "B") or bare) if m else None
    if not m or unit is None or unit not in _UNITS:
        hint = f" (a bare number means {bare})" if bare else " (a bare number is ambiguous: give the unit)"
        raise ConfigError(f"{text!r} is not a size: use e.g. 256MB, 64KB, 8GB{hint}")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_gb(text) -> int:
    """GPU memory: '8GB', '8000MB', or a bare 8 meaning 8 GB."""
    return parse_size(text, bare="GB")


def parse_workers(text):
    """Loader workers: a count (0 = in the training process), 'auto' (the cores per device, less one) or 'probe'
    (measured once on this machine and data set, then cached)."""
    if text in (None, "auto"):
        return None
    if text == "probe":
        return "probe"
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"--workers {text!r}: use a number (0 = in this process), auto or probe") from None
    if n < 0:
        raise ConfigError(f"--workers {n}: use 0 or more")
    return n


def parse_procs(text):
    """Processes for the converter: a count (0 or 1 = in this process) or 'auto' (every usable core)."""
    if text in (None, "auto"):
        return None
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"--workers {text!r}: use a number (0 = in this process) or auto (every core)") from None
    if n < 0:
        raise ConfigError(f"--workers {n}: use 0 or more")
    return n


def parse_onoff(text):
    if isinstance(text, bool) or text is None:
        return text
    if text not in ("on", "off", "auto"):
        raise ConfigError(f"{text!r}: use on, off or auto")
    return {"on": True, "off": False, "auto": None}[text]
