"""SIGINT and SIGTERM during training: finish the current step, then stop at a safe point.

Raising from a signal handler can land anywhere, including a finaliser (a DataLoader iterator being collected),
where Python swallows the exception and training goes on. So the handler only records the request; the loop asks
`check()` between steps and stops there. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import signal
import sys
import threading

from fastpipe.errors import Interrupted


class StopRequest:
    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise Interrupted(self.signal_name)  # asked twice: no more waiting
        self.signal_name = signal.Signals(signum).name
        # said at once: a step on a CPU can take minutes, and a silent Ctrl-C looks ignored
        again = "; Ctrl-C again to stop at once" if signum == signal.SIGINT else ""
        print(f"\n{self.signal_name}: stopping after this step, with a checkpoint{again}", file=sys.stderr, flush=True)

    def check(self) -> None:
        if self.signal_name is not None:
            raise Interrupted(self.signal_name)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
