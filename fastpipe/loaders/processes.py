"""Worker processes' plumbing: how they start (fork, or forkserver beside DALI), the signals they obey, a death
said where the training loop can handle it, and their end at interpreter exit."""

from __future__ import annotations

import os
import sys

from fastpipe.loaders import cpu_ops


def worker_context():
    """fork (fast, the default) unless this process holds DALI: a forked copy of a DALI pipeline hangs in its
    destructor when the child's garbage collector meets it (DALI 2.4). Then forkserver: workers fork from a
    clean server process that has imported this module once."""
    if "nvidia.dali" not in sys.modules:
        return None
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    # SIGTERM held in the server, so in each worker until worker_init (forkserved.py); then the loader's imports, once
    ctx.set_forkserver_preload(["fastpipe.loaders.forkserved", "fastpipe.loaders.stream"])
    return ctx


def dead_workers_at_the_next_batch() -> None:
    """PyTorch reports a dead worker from a SIGCHLD handler, which raises in whatever the main thread is doing at
    that moment: a model's forward pass, an optimizer step half applied, a checkpoint being written. Its handler is
    set once per process; put back the one it replaced, and a dead worker surfaces where it can be handled: in the
    next batch request (the DataLoader checks its workers every few seconds while it waits for one)."""
    import signal
    import threading

    handler = signal.getsignal(signal.SIGCHLD)
    if threading.current_thread() is not threading.main_thread() or \
            getattr(handler, "__qualname__", "") != "_set_SIGCHLD_handler.<locals>.handler":
        return
    replaced = next((c.cell_contents for c in handler.__closure__ or () if callable(c.cell_contents)), None)
    signal.signal(signal.SIGCHLD, replaced or signal.SIG_DFL)


def deaths_named(it, bound_s: float = 10.0):
    """The DataLoader iterator's batches, with a worker's death said as PyTorch says it ("DataLoader worker ...
    exited unexpectedly") however it shows first. A batch's tensors are handed over by the worker that made it (a
    file descriptor through the worker's resource sharer): when that worker is killed, receiving the batch can fail
    (EOFError, a refused connection) before PyTorch can see the process end. PyTorch then raises that error as it is,
    or, where the batch is received by its pin-memory thread (CUDA), says that thread ended. Whether a worker ended
    is waited for on the processes' sentinels, at most `bound_s` seconds."""
    from multiprocessing.connection import wait

    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except (EOFError, ConnectionError, FileNotFoundError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and str(e) != "Pin memory thread exited unexpectedly":
                raise
            workers = list(getattr(it, "_workers", ()))
            ended = set(wait([w.sentinel for w in workers], timeout=bound_s)) if workers else set()
            if not ended:
                raise
            pids = ", ".join(str(w.pid) for w in workers if w.sentinel in ended)
            raise RuntimeError(f"DataLoader worker (pid(s) {pids}) exited unexpectedly") from e
        yield batch


def worker_init(worker_id: int, main_pid: int) -> None:
    """DataLoader worker_init_fn: one OpenCV thread, and signals obeyed only from the process that owns us.

    Ctrl-C in a terminal and the SIGTERM of torchrun, Slurm or a `kill -- -PGID` reach the whole process group;
    a worker dying of it would fail the step the main process is finishing before it saves its checkpoint. So
    SIGINT is ignored, and SIGTERM is taken by a thread that ends the worker only when the main process sent it
    (DataLoader's and multiprocessing's own fallback when a worker does not stop in time: ignoring that one hung
    the interpreter's exit). Workers still exit when the main process dies (DataLoader's watchdog)."""
    import signal
    import threading

    cpu_ops.one_thread(worker_id)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # macOS: SIGTERM keeps its default action
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # inherited by every thread started from here

    def obey():
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != main_pid:
            pass
        os._exit(0)

    threading.Thread(target=obey, name="fastpipe-sigterm", daemon=True).start()


def started_holding_sigterm(start):
    """start() (which forks the worker processes) with SIGTERM held in this thread: a forked worker inherits the mask,
    so a SIGTERM sent to the process group while it starts (torchrun's, Slurm's) waits until _worker_init has set up
    who may end it, instead of killing it before. Held here for the fork's few milliseconds, then delivered."""
    import signal

    if not hasattr(signal, "sigwaitinfo"):  # macOS: _worker_init leaves SIGTERM to its default action there
        return start()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def stop_workers(ref) -> None:
    """At interpreter exit, before multiprocessing's own exit handler (which signals workers and waits for them):
    DataLoader's own shutdown (an event and a sentinel) ends them at once."""
    loader = ref()
    if loader is not None:
        loader.close()
