"""Imported by the server process that forks the worker processes where the training process holds DALI
(processes.worker_context), and by nothing else: SIGTERM is held in it, so that each worker forked from it starts
with SIGTERM held, as a worker forked from the training process does (processes.started_holding_sigterm), until
processes.worker_init has set up who may end it. A SIGTERM that torchrun or Slurm sends to the process group while
a worker starts then waits instead of killing it. The server itself ends when the training process does (its end
of the server's pipe closes)."""

import signal

if hasattr(signal, "sigwaitinfo"):  # as worker_init: macOS leaves SIGTERM to its default action
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
