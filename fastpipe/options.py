"""Declaring settings once: a config dataclass field carries its CLI help, flag and parser with its default.

    batch_size: int = opt(64, "images per device and step")

`fastpipe.cli` builds every subcommand's flags from these fields (flag = --field-name, kebab-case), so a
default or a help text exists in exactly one place. Parsers for values people type (sizes, worker counts) live
here too, and refuse what they cannot read with the fix.

Every numeric setting also carries its range (`low`/`high` inclusive, `above`/`below` exclusive). `check(cfg)`,
called by each config's `__post_init__`, checks every field once where the config is built, for the CLI and the
Python API alike: the type, NaN and infinity, and the range, with the value and what is allowed in the message.
"""

from __future__ import annotations

import argparse
import math
import re
import types
import typing
from dataclasses import MISSING, field, fields

from fastpipe.errors import ConfigError

MAX_IMAGE_SIZE = 4096  # pixels: the largest training/bench image size (a batch of them is already gigabytes)
SEED_MAX = 2**32 - 1  # what every seeded generator (numpy, torch, Python) takes
_UNITS = {"K": 1024, "KB": 1024, "M": 1024**2, "MB": 1024**2, "G": 1024**3, "GB": 1024**3, "T": 1024**4,
          "TB": 1024**4, "B": 1}


def opt(default, help: str, *, flag: str | None = None, parse=None, choices=None, positional: bool = False,
        nargs=None, cli: bool = True, sweep: bool = False, low=None, high=None, above=None, below=None):
    """A dataclass field with its command-line description. `cli=False` keeps a setting out of the CLI;
    `sweep=True` lets the CLI take comma-separated values (fastpipe bench runs each). `low`/`high` (inclusive) and
    `above`/`below` (exclusive) bound a number; `check` enforces them with the type."""
    meta = {"help": help, "flag": flag, "parse": parse, "choices": choices, "positional": positional,
            "nargs": nargs, "cli": cli, "sweep": sweep, "range": (low, high, above, below)}
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


def parse_device(text):
    """A torch device: cpu, cuda or cuda:N (None: cuda when available). Checked here, before torch is imported."""
    if text is None or re.fullmatch(r"cpu|cuda(:\d{1,3})?", str(text)):
        return text
    raise ConfigError(f"--device {str(text)[:40]!r}: use cpu, cuda or cuda:N (a GPU's index)")


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


def amp_for(amp: str | None, cuda: bool) -> str:
    """The mixed precision a device gets: fp16 by default on CUDA, off on a CPU. fp16 asked for on a CPU is off,
    said once: PyTorch has no fast fp16 kernels there (about 20x slower than fp32)."""
    if amp == "fp16" and not cuda:
        import warnings

        from fastpipe.errors import FastpipeWarning

        warnings.warn("--amp fp16 on a CPU is about 20x slower than fp32 (no fp16 kernels there): running with --amp "
                      "off; --amp bf16 helps only on CPUs with bf16 instructions (AVX-512 BF16, AMX)", FastpipeWarning,
                      stacklevel=3)
        return "off"
    return amp or ("fp16" if cuda else "off")


# -- normalisation ---------------------------------------------------------------------------------------------
# The mean/std torchvision's and timm's ImageNet weights were trained with (0-1 scale, RGB).
IMAGENET_MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
NORMALIZE_FORMS = ("dataset (the data set's own mean/std), imagenet (what ImageNet weights were trained with) or "
                   "M1,M2,M3:S1,S2,S3 (per-channel mean and std on the 0-1 scale)")
# The smallest std: one grey level on the 0-1 scale. Below it, a difference of one level becomes more than one std
# (1e-300 makes every pixel infinite); a data set's channel that never varies (std 0) is normalised with it too.
STD_FLOOR = 1 / 255


def parse_normalize(value):
    """The normalisation setting, as typed or given in Python, in one form: "dataset", "imagenet" or the text
    "M1,M2,M3:S1,S2,S3"; also False (uint8 output, the loaders only). True and a (mean, std) pair (tuples, lists,
    a 2 x 3 numpy array or tensor) are accepted. The text is what is used, exactly."""
    if isinstance(value, bool):
        return "dataset" if value else False
    if isinstance(value, str) and value in ("dataset", "imagenet"):
        return value
    given = value if isinstance(value, str) else getattr(value, "tolist", lambda: value)()  # shown on one line
    if isinstance(value, str):
        value = value.split(":") if value.count(":") == 1 else None
    try:
        mean, std = ([float(x) for x in (part.split(",") if isinstance(part, str) else part)] for part in value)
    except (TypeError, ValueError):
        raise ConfigError(f"--normalize {given!r}: use {NORMALIZE_FORMS}") from None
    if len(mean) != 3 or len(std) != 3 or not all(math.isfinite(x) for x in mean + std):
        raise ConfigError(f"--normalize {given!r}: needs three finite means and three stds, one per channel (R,G,B): "
                          f"use {NORMALIZE_FORMS}")
    if not all(0 <= m <= 1 for m in mean) or not all(STD_FLOOR <= s <= 1 for s in std):
        raise ConfigError(f"--normalize {normalize_text(mean, std)}: mean and std are on the 0-1 scale, means "
                          f"within 0..1 and stds within 1/255 (one grey level, {STD_FLOOR:.6f})..1 (ImageNet's: "
                          f"{normalize_text(*IMAGENET_MEAN_STD)}, or say imagenet)")
    return normalize_text(mean, std)


def normalize_text(mean, std) -> str:
    """Mean and std as the setting's text form (exact: each number's shortest repr)."""
    return ",".join(repr(float(x)) for x in mean) + ":" + ",".join(repr(float(x)) for x in std)


def normalization(value, dataset_mean, dataset_std) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The (mean, std) a normalisation setting means for a data set with these statistics; None for uint8. What it
    returns is what the loaders divide by and what runs record: a data set's std below STD_FLOOR (a channel that never
    varies) is the floor here, in both."""
    value = parse_normalize(value)
    if value is False:
        return None
    if value == "dataset":
        return tuple(dataset_mean), tuple(max(float(s), STD_FLOOR) for s in dataset_std)
    if value == "imagenet":
        return IMAGENET_MEAN_STD
    mean, std = value.split(":")
    return tuple(float(x) for x in mean.split(",")), tuple(float(x) for x in std.split(","))


def parse_onoff(text):
    if isinstance(text, bool) or text is None:
        return text
    if text not in ("on", "off", "auto"):
        raise ConfigError(f"{text!r}: use on, off or auto")
    return {"on": True, "off": False, "auto": None}[text]


def parse_threads(text):
    """--threads: on (threads of the training process), off (processes), helper (threads in one helper process),
    auto (threads, moved to processes after the first epoch where the training step's Python never pauses)."""
    if text == "helper":
        return text
    if isinstance(text, bool) or text is None or text in ("on", "off", "auto"):
        return parse_onoff(text)
    raise ConfigError(f"{text!r}: use on, off, helper or auto")


# -- checking a config once, where it is built ------------------------------------------------------------
def flag_name(name: str, meta=None) -> str:
    """How a user names a setting: its flag (the Python API takes the same name with underscores)."""
    return (meta or {}).get("flag") or f"--{name.replace('_', '-')}"


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def describe_range(low=None, high=None, above=None, below=None) -> str:
    lo = f">= {_num(low)}" if low is not None else f"> {_num(above)}" if above is not None else None
    hi = f"<= {_num(high)}" if high is not None else f"< {_num(below)}" if below is not None else None
    if low is not None and high is not None:
        return f"within {_num(low)}..{_num(high)}"
    return " and ".join(x for x in (lo, hi) if x) or "a number"


def is_integer(value) -> bool:
    """An int that is not a bool: Python's True is the int 1, and num_workers=True was taken for one worker (or
    failed later, deep in torch): a count or a size given as True/False is a mistake to refuse, not a number."""
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(low=None, high=None, above=None, below=None) -> str:
    """'an integer' and its range in words ('an integer >= 1'), for a message."""
    bounded = any(x is not None for x in (low, high, above, below))
    return "an integer" + (f" {describe_range(low, high, above, below)}" if bounded else "")


def check_number(name: str, value, kind: type = float, low=None, high=None, above=None, below=None):
    """`value` if it is a number of `kind` within the range, else a ConfigError naming the setting, the value and
    what is allowed. NaN and infinity are never allowed; an int setting takes only integers (not True/False)."""
    allowed = describe_range(low, high, above, below)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int and not is_integer(value):
        raise ConfigError(f"{name} {value!r}: must be {_integer(low, high, above, below)}")
    if not number or not math.isfinite(value):
        raise ConfigError(f"{name} {value!r}: must be a finite number {allowed}")
    if ((low is not None and value < low) or (high is not None and value > high)
            or (above is not None and value <= above) or (below is not None and value >= below)):
        raise ConfigError(f"{name} {value!r}: must be {allowed}")
    return value


def _plain(hint) -> tuple[tuple, bool]:
    """(the plain types a hint allows, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        return tuple(a for a in args if a is not type(None)), type(None) in args
    return (hint,), False


def _check_one(name: str, value, hint, meta) -> None:
    kinds, optional = _plain(hint)
    if value is None:
        if not optional and not meta.get("positional"):
            raise ConfigError(f"{name}: a value is needed")
        return
    rng = meta.get("range") or (None,) * 4
    # A count or a word (workers: 4, auto, probe): True is neither, though it is an int (the help names the words).
    # Before the choices: True == 1 would pass for a choice of 1.
    if isinstance(value, bool) and bool not in kinds and int in kinds and str in kinds:
        raise ConfigError(f"{name} {value!r}: must be {_integer(*rng)} or a word ({meta.get('help', 'text')}), not "
                          f"true or false")
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{name} {value!r}: use one of {', '.join(map(str, meta['choices']))}")
    if bool in kinds and isinstance(value, bool):
        return
    if float in kinds and isinstance(value, (int, float)) and not isinstance(value, bool):
        check_number(name, value, float, *rng)
    elif int in kinds and (is_integer(value) or str not in kinds):
        check_number(name, value, int, *rng)
    elif str in kinds and isinstance(value, str):
        return
    elif len(kinds) == 1 and kinds[0] in (int, float, bool, str):
        wanted = {int: "an integer", float: "a number", bool: "true or false", str: "text"}[kinds[0]]
        raise ConfigError(f"{name} {value!r}: must be {wanted}")


def check(cfg) -> None:
    """Every setting of a config dataclass against its type and range (opt's `low`/`high`/`above`/`below`); the
    values of a swept setting each. Raises ConfigError naming the first that is not allowed."""
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        if not f.metadata:
            continue
        value, name = getattr(cfg, f.name), flag_name(f.name, f.metadata)
        for v in (value if f.metadata.get("sweep") and isinstance(value, list) else [value]):
            _check_one(name, v, hints[f.name], f.metadata)


# -- flags from config dataclasses ------------------------------------------------------------------------
def _argtype(parse):
    """argparse shows only ArgumentTypeError messages; ours explain the fix, so pass them through."""
    def wrapped(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    wrapped.__name__ = getattr(parse, "__name__", "value")
    return wrapped


def _base_type(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and typing.get_origin(hint) in (typing.Union, __import__("types").UnionType)\
        else hint


def _default(f):
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def _sweep(parse):
    return lambda text: [parse(x.strip()) for x in str(text).split(",") if x.strip()]


def add_config(p: argparse.ArgumentParser, cls, skip=()) -> None:
    """One flag per field of `cls` with opt() metadata: --field-name, its help and default from the field.
    Defaults are left out of the namespace (SUPPRESS), so `config_from` knows what the user typed."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        m = f.metadata
        if not m or not m.get("cli", True) or f.name in skip:
            continue
        kind, default = _base_type(hints[f.name]), _default(f)
        parse = m["parse"] or (kind if kind in (int, float, str) else str)
        shown = "" if default in (None, False, "", []) or m["positional"] else f" (default: {default})"
        if m["positional"]:
            p.add_argument(f.name, metavar=m["flag"] or f.name.upper(), nargs=m["nargs"], type=_argtype(parse),
                           help=m["help"])
        elif kind is bool and not m["sweep"] and m["parse"] is None:  # else its parser's words (on/off)
            action = "store_true" if default is False else argparse.BooleanOptionalAction
            p.add_argument(m["flag"] or f"--{f.name.replace('_', '-')}", dest=f.name, action=action,
                           default=argparse.SUPPRESS, help=m["help"] + shown)
        else:
            parse = _sweep(parse) if m["sweep"] else parse
            help_ = m["help"] + shown + (" (comma-separated values are swept)" if m["sweep"] else "")
            p.add_argument(m["flag"] or f"--{f.name.replace('_', '-')}", dest=f.name, type=_argtype(parse),
                           choices=None if m["sweep"] else m["choices"], nargs=m["nargs"],
                           default=argparse.SUPPRESS, help=help_)


def given(args: argparse.Namespace, cls) -> dict:
    """The settings of `cls` the user typed (and the positionals)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


def config_from(args: argparse.Namespace, cls, **extra):
    return cls(**{**given(args, cls), **extra})
