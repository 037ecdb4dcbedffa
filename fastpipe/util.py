"""Small utilities every layer uses: atomic writes, bounded reads, folder locks, core counts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import sys
import threading
import time
from pathlib import Path

from fastpipe.errors import BusyError, DataError


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask: what a container or `taskset` allows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def unreachable(address: str, timeout: float = 10.0) -> str | None:
    """Why `address` (HOST:PORT, or SCHEME://HOST:PORT) does not take a TCP connection within `timeout` seconds;
    None when it does. For services whose own clients wait minutes on a wrong address before they fail."""
    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except ValueError:
        return f"{address!r} is not HOST:PORT"
    except OSError as e:
        return f"{host}:{port} does not answer ({e.strerror or e})"
    return None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write under a temporary name in the same folder, fsync, then rename: a reader sees the old file or the
    whole new one, never half (a kill, a full disk)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json_atomic(path: Path, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


class NotRegularFile(DataError):
    """A FIFO, device, socket or folder where a file was expected."""


class FileTooLarge(DataError):
    """A file larger than the limit the caller set."""


@contextlib.contextmanager
def signals_deferred():
    """Ctrl-C and SIGTERM received inside the block take effect when it ends, so that what it does (closing a
    shard: its bytes synced, its index, its final name, its journal line) is done whole or not at all. Only the
    main thread can change handlers; elsewhere the block runs as it is."""
    import signal

    kinds = (signal.SIGINT, signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or None in map(signal.getsignal, kinds):
        yield  # None: a handler set outside Python, which could not be put back
        return
    got: list[int] = []
    before = {s: signal.signal(s, lambda n, _frame: got.append(n)) for s in kinds}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        for n in got[:1]:
            signal.raise_signal(n)  # to the handler it would have met


def read_regular(path: Path, limit: int, opener=None) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. FIFOs, devices and sockets (a link to /dev/zero, a
    named pipe that would block forever) and larger files raise OSError/DataError instead of hanging or
    exhausting memory. `opener`: os.open's stand-in (one that refuses links and others' files: cachefiles)."""
    with open(path, "rb", opener=opener or _nonblocking_opener) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{path}: not a regular file ({_kind(st.st_mode)})")
        if st.st_size > limit:
            raise FileTooLarge(f"{path}: {st.st_size} bytes, more than the limit of {limit}")
        # Ask for the size it has, plus one byte to see growth: read(limit + 1) allocated a buffer of the limit
        # (1 GB) for every file: 489 us a demo photo against 127 us (benchmarks/bench_io.py).
        data = f.read(st.st_size + 1)
        if len(data) > st.st_size:  # grew while reading
            data += f.read(limit + 1 - len(data))
    if len(data) > limit:
        raise FileTooLarge(f"{path}: more than the limit of {limit} bytes")
    return data


JSON_LIMIT = 64 << 20  # bytes: a JSON document fastpipe reads (dataset.json, a run's records, an export's record)
JSON_DEPTH = 100  # levels of nesting: fastpipe's own documents have under 20, torch.export's graphs about 12


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class JSONTooDeep(ValueError):
    """A JSON document nested deeper than any fastpipe reads (json.loads would exhaust Python's recursion)."""


def parse_json(data: bytes | str, max_depth: int = JSON_DEPTH):
    """A JSON document from outside (a file, a store, a line of a log), its nesting checked before parsing: a
    ValueError (JSONDecodeError, JSONTooDeep) for anything but plain JSON, never a RecursionError."""
    # As UTF-8 text: json.loads would take UTF-16 or UTF-32 bytes too, in which a quote or a bracket is not the
    # byte the count below looks for.
    text = data.decode("utf-8-sig") if isinstance(data, (bytes, bytearray)) else data
    raw = text.encode("utf-8", "surrogatepass")
    # Nesting deeper than max_depth takes more than 2 x max_depth brackets (closed or not); those inside strings
    # do not count.
    if len(raw.translate(None, _NOT_BRACKETS)) > 2 * max_depth:
        import numpy as np

        steps = np.frombuffer(_STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS), np.uint8)
        if int(np.cumsum(np.where(steps & 0x0F == 0x0B, 1, -1)).max()) > max_depth:  # [{ open, ]} close
            raise JSONTooDeep(f"nested more than {max_depth} levels deep")
    try:
        return json.loads(text)
    except RecursionError:  # not reachable after the count; kept so that no reader ever meets one
        raise JSONTooDeep(f"nested more than {max_depth} levels deep") from None


def read_json(path: Path, limit: int = JSON_LIMIT):
    """A JSON file fastpipe did not just write: a regular file of at most `limit` bytes (OSError, DataError), then
    `parse_json` (ValueError)."""
    return parse_json(read_regular(Path(path), limit))


def _nonblocking_opener(path, flags):
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


class FolderLock:
    """An exclusive lock on an output folder (flock on FOLDER/.fastpipe.lock), held while a command writes there.

    A second writer fails at once with who holds it (pid, host, command, since when); the lock is released by
    the kernel when the holder exits, even by kill -9, so a stale file never blocks a rerun."""

    NAME = ".fastpipe.lock"

    def __init__(self, folder: Path, command: str):
        self.path, self.command, self._fh = Path(folder) / self.NAME, command, None

    def __enter__(self) -> FolderLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise BusyError(f"{self.path.parent} is being written by {holder}; wait for it to finish "
                            f"(or stop it), then rerun") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()} (`{self.command}`, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        fh.flush()
        self._fh = fh
        return self

    def __exit__(self, *exc) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.truncate(0)
            self._fh.close()  # closing releases the flock
            self._fh = None


def command_line() -> str:
    return " ".join(["fastpipe", *sys.argv[1:]]) if sys.argv and sys.argv[0].endswith("fastpipe") \
        else " ".join(sys.argv) or "python"


def pool_context():
    """The multiprocessing context for a pool of plain Python workers (the converter's). fork where it is safe:
    workers start at once and do not re-import the caller's main module (a script that imports torch made every
    spawned worker import torch too, seconds each). spawn when the parent
    holds state a fork would copy broken: an initialised CUDA context, or a DALI pipeline (whose forked copy
    hangs in its destructor: loaders/stream.py)."""
    import multiprocessing

    torch = sys.modules.get("torch")
    if "nvidia.dali" in sys.modules or (torch is not None and torch.cuda.is_initialized()):
        return multiprocessing.get_context("spawn")
    return multiprocessing.get_context("fork")


def reuse_freed_memory(mmap_below: int = 32 << 20, keep_up_to: int = 128 << 20) -> bool:
    """Make glibc's malloc keep and reuse the memory this process frees, instead of handing it back to the system
    and asking for fresh pages for the next image. For a process that works on one photo after another (a
    conversion worker): each image's megabyte-sized buffers otherwise come from new mmaps, and every new page is a
    fault. Measured by benchmarks/bench_malloc.py, `shard()` called from a fresh process: 946 page faults and
    12.8 ms of worker CPU per demo photo with glibc's defaults, 48 and 11.0 ms with this, 1.17x the images/s.
    Whether the defaults cost that depends on what the process had allocated before it forked, so it came and
    went by chance (in by-hand runs the CLI's workers escaped it). Allocations of `mmap_below` and more still get
    their own mapping, and at most `keep_up_to` bytes of free heap are kept, so a worker that met one huge image
    does not hold its memory for good. False (and nothing changed) outside glibc.

    Only for processes fastpipe owns: it is process-wide, and a caller's own process keeps its allocator as is."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    m_trim_threshold, m_mmap_threshold = -1, -3  # from malloc.h
    # A fixed mmap threshold also stops glibc's own adjustment of it, which left a worker fast or slow by chance.
    return bool(mallopt(m_mmap_threshold, mmap_below)) and bool(mallopt(m_trim_threshold, keep_up_to))


class Ticker:
    """Calls `tick()` every `seconds` on a daemon thread for the length of a `with` block."""

    def __init__(self, seconds: float, tick, name: str = "fastpipe-ticker"):
        self.seconds, self.tick = seconds, tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            self.tick()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
