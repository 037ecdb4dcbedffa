"""Joining a Ray cluster for `fastpipe shard --ray`, and leaving nothing behind on it: the address checked before Ray's
own client is given it, and the progress board, an actor that ends with the process that made it. With onray.py (the
pool), the only modules that import Ray.

Ray's client waits for minutes on an address that takes connections but is not Ray (a web server, a database): the
address must take a TCP connection and then answer Ray's first call within --ray-timeout seconds, or the run stops in
one line naming it. The board is the run's process's (Ray ends it with its owner), and it also watches that process
itself: a run killed with its process group (SIGKILL, no clean-up) left the board's process behind, since that
process's group is Ray's, not the run's.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time

import psutil
import ray

from fastpipe.errors import ConfigError
from fastpipe.store.urls import redact
from fastpipe.util import unreachable, usable_cores

WATCH_SECONDS = 1.0  # how often the board looks whether the process that made it is still there


@ray.remote(num_cpus=0)
class Board:
    """Which task runs on which node, and how many times each was run again. `driver`: the process that made it
    (node, host, pid, start time), which it ends with."""

    def __init__(self, driver: tuple[str, str, int, float]):
        self.running, self.starts, self.again = {}, collections.Counter(), {}
        threading.Thread(target=_end_with, args=driver, daemon=True, name="fastpipe-driver-watch").start()

    def started(self, key: int, node: str, attempt: int | None) -> None:
        """`attempt`: which try this is, where Ray says (records of two tries may arrive in either order); else the
        starts recorded are counted."""
        self.starts[key] += 1
        seen = attempt if attempt is not None else self.starts[key] - 1
        if seen >= self.again.get(key, 0):  # not the late record of a try already superseded (its node is not busy)
            self.running[key] = node
        self.again[key] = max(self.again.get(key, 0), seen)

    def finished(self, key: int) -> None:
        self.running.pop(key, None)

    def snapshot(self) -> tuple[int, int]:
        """(runs again of all tasks, nodes running a task now)."""
        return sum(self.again.values()), len(set(self.running.values()))

    def runs_again(self) -> dict[int, int]:
        return dict(self.again)


def driver() -> tuple[str, str, int, float]:
    """This process, as the board watches it: its node, host, pid and start time (a pid can be reused)."""
    me = psutil.Process()
    return ray.get_runtime_context().get_node_id(), socket.gethostname(), me.pid, me.create_time()


def _end_with(node: str, host: str, pid: int, started: float) -> None:
    """End this process (the board's) once the driver's is gone. Only on the driver's node: a pid names nothing on
    another (there, Ray's own end of an actor with its owner is all there is)."""
    if ray.get_runtime_context().get_node_id() != node or socket.gethostname() != host:
        return
    while _alive(pid, started):
        time.sleep(WATCH_SECONDS)
    os._exit(0)


def _alive(pid: int, started: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.AccessDenied:  # cannot tell: as long as it is there
        return True
    except psutil.Error:  # gone (or a zombie waiting for its parent)
        return False


def connect(address: str | None, cpus: int | None, timeout: float) -> tuple[str, bool]:
    """(where the tasks run, whether this pool joined Ray and so leaves it at the end). A process already in a Ray
    session (a notebook that called ray.init) keeps it. `timeout`: the seconds a cluster has to answer as Ray."""
    if ray.is_initialized():
        return "the Ray session of this process", False
    address = address or os.environ.get("RAY_ADDRESS") or None
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False}
    problem = unreachable(address) or _not_ray(address, timeout) if address and address != "auto" else None
    if problem:  # Ray's own client would try for minutes before it gave up
        raise ConfigError(f"cannot join the Ray cluster at {redact(address)}: {problem}. Give the head node's "
                          f"address (--ray-address or RAY_ADDRESS; `ray status` on the head prints it)")
    try:
        if address:
            ray.init(address=address, **quiet)
            return f"cluster at {redact(address)}", True
        n = cpus or usable_cores()
        ray.init(num_cpus=n, include_dashboard=False, **quiet)
        return f"a local cluster of {n} CPUs", True
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"cannot join the Ray cluster at {redact(address or 'a local start')}: {first}. Give the "
                          f"head node's address (--ray-address or RAY_ADDRESS; `ray status` on the head prints it)"
                          ) from None


def _not_ray(address: str, timeout: float) -> str | None:
    """Why the server at `address` is not a Ray cluster's head, when it does not answer Ray's first call (the
    cluster's id, over gRPC) within `timeout` s; None when it answers, even with a refusal (a token it wants): Ray's
    client waits minutes on a port that takes connections but speaks something else (a web server, a database)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    target = address.split("://", 1)[-1].rstrip("/")
    try:  # Ray's own channel: its TLS and token settings (RAY_USE_TLS, RAY_AUTH_MODE)
        from ray._private.grpc_utils import init_grpc_channel

        channel = init_grpc_channel(target)
    except Exception:  # not in this Ray release: a plain channel
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(gcs_service_pb2.GetClusterIdRequest(),
                                                                               timeout=timeout)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                why = (str(e.details() or e.code().name).splitlines() or [""])[0][:200]
                return (f"it takes connections but does not answer as a Ray cluster within {timeout:g} s "
                        f"(--ray-timeout): {why}")
    return None


__all__ = ["Board", "connect", "driver"]
