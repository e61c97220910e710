"""How many torch intra-op threads an engine uses on the CPU.

torch's OpenMP threads meet at a barrier after every parallel op (hundreds per decode step of
a small model). With as many threads as cores and another process busy on one of them, every
barrier waits for a thread the OS has descheduled: on 2 cores, 8 tokens of SmolLM2-135M took
17 s instead of 0.97 s with one thread (issue 29). A passive OpenMP wait policy does not help:
the team still waits for its descheduled member (on a 2-core machine busy with other
processes: 5.8 tok/s with 2 passive threads, 16.5 with one), and it would have to be set before
torch loads OpenMP, which the Python API cannot do. So the default counts the cores that are
free when the engine starts and uses that many threads, at least one: too many threads
costs 13-18x under contention, too few at most the parallel speed-up, so a core counts as free
only when at least 3/4 of it is idle. Contention that starts after the engine is not seen;
there `--threads 1` (`num_threads=1`) is the safe choice.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

# The most threads the default uses: torch's count when blockdraft is imported (one per
# physical core, or OMP_NUM_THREADS, or what the application chose before), or the count the
# application set since with torch.set_num_threads. A count blockdraft set itself does not
# lower it, so a later engine can go back up after an earlier one went down.
_ceiling = torch.get_num_threads()
_applied: int | None = None  # the count blockdraft set last

_SAMPLES = 20  # reads of the run queue, _SAMPLE_GAP_S apart: 40 ms at engine start
_SAMPLE_GAP_S = 0.002
_ROUND_UP_FROM = 0.75  # a core counts as free when at least this much of it is idle


@dataclass(frozen=True)
class ThreadChoice:
    num_threads: int
    reason: str  # for the start-up line, e.g. "auto: 2 cores, 1.0 busy with other processes"


def choose_num_threads(requested: int | None) -> ThreadChoice:
    """`requested`, or the cores free now: at least 1, at most the process's count (torch's
    default, or what the application set)."""
    if requested is not None:
        return ThreadChoice(requested, "as asked")
    usable = _usable_cpus()
    cores = min(_current_ceiling(), usable)
    # Other work spread evenly over the host's CPUs; the share that lands on ours.
    busy = _other_runnable() * usable / (os.cpu_count() or usable)
    free = int(cores - busy + (1 - _ROUND_UP_FROM))
    n = max(1, min(cores, free))
    return ThreadChoice(n, f"auto: {cores} cores, {busy:.1f} busy with other processes")


def apply_num_threads(requested: int | None) -> ThreadChoice:
    """Chooses (see `choose_num_threads`) and sets the process's torch thread count."""
    global _applied
    _current_ceiling()  # notes a count the application set, before blockdraft changes it
    choice = choose_num_threads(requested)
    torch.set_num_threads(choice.num_threads)
    _applied = choice.num_threads
    return choice


def _current_ceiling() -> int:
    global _ceiling
    current = torch.get_num_threads()
    if current != _applied:  # set by the application, not by blockdraft
        _ceiling = current
    return _ceiling


def _usable_cpus() -> int:
    """CPUs this process may run on (a container's cpuset, taskset), not the host's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _other_runnable() -> float:
    """Threads of other processes running or ready to run, across the host's CPUs.

    Linux: the run queue now (/proc/loadavg's running count, which includes the reading
    thread), averaged over a few reads; a new competitor counts at once, where the 1-minute
    load average would take a minute to show it. Elsewhere: the 1-minute load average."""
    try:
        counts = []
        for _ in range(_SAMPLES):
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
            time.sleep(_SAMPLE_GAP_S)
        return max(0.0, sum(counts) / len(counts))
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
