"""The CPUs a process may use, and ZeroMQ's I/O threads on all of them.

An inference engine may bind the thread that opens kvpool to a few cores (vLLM-CPU binds its
model threads, the main thread among them, to ``VLLM_CPU_OMP_THREADS_BIND``), and every thread
started from it inherits that binding, ZeroMQ's I/O thread too. A master round trip made while
the model's own thread waits for it (a step's saves are published before its output leaves the
engine) then needs that I/O thread twice, on whatever cores it was left on: with two engines on
a host, one per core, those were the other engine's compute core, busy for a whole prefill. In
the served benchmark such publishes took 100-700 ms where they take 1 ms (docs/benchmarks.md)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import zmq

__all__ = ["io_threads_anywhere", "process_cpus"]


def process_cpus(known: Iterable[int] = ()) -> frozenset[int]:
    """Every CPU this process may use (the kernel keeps those of its cpuset), whatever the
    calling thread is bound to; ``known``: CPU ids to ask for at least, beyond
    ``os.cpu_count()``. The calling thread's binding is left as it was."""
    if not hasattr(os, "sched_setaffinity"):
        return frozenset(range(os.cpu_count() or 1))
    bound = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, range(max(os.cpu_count() or 1, max({*bound, *known}) + 1)))
        return frozenset(os.sched_getaffinity(0))
    except OSError:
        return frozenset(bound)
    finally:
        os.sched_setaffinity(0, bound)


def io_threads_anywhere(context: zmq.Context[Any]) -> None:
    """Let ``context``'s I/O threads run on every CPU this process may use, when the calling
    thread is bound to fewer. ZeroMQ starts them with the context's first socket; on a context
    already started (one shared with another library) this changes nothing."""
    if not hasattr(os, "sched_getaffinity"):
        return
    cpus = process_cpus()
    if cpus == os.sched_getaffinity(0):  # not bound: its threads inherit every CPU anyway
        return
    for cpu in sorted(cpus):
        context.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
