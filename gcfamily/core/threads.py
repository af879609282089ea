"""How many CPU threads torch runs with: the count a run chooses, and how busy the machine's cores are right now.

torch's intra-op threads wait for one another at the end of every parallel region by spinning; when another process holds
one of the cores, the others spin until the pre-empted thread runs again, so a run beside one busy process took 3.6x its
quiet time (SmolLM2-135M SFT on 2 cores) and rollouts 17x. `choose_threads` is the rule (pure: the figures go in, the count
and the sentence that explains it come out); `busy_cores` measures the figure it needs from /proc/stat; `decide` puts
the two together for a run (gcfamily/run/build.py), and `apply` sets torch's count.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from gcfamily.core.cgroup import cgroup_quota
from gcfamily.errors import GcfError

BUSY_FROM = 0.8
"""A core counts as busy once this share of it was in use over the window: a process that spins on a core reads 0.95-1.0
of it over a fraction of a second (the kernel's tick is 10 ms), never exactly 1; a core used less counts as free."""

WINDOW_S = 0.3
"""Seconds over which busy_cores compares the CPU times in /proc/stat."""


@dataclass(frozen=True)
class Threads:
    """A run's choice: the count, the sentence that explains it, and the busy cores measured for it (None: not measured)."""

    count: int
    reason: str
    busy: Optional[float] = None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def counted_busy(busy: float) -> int:
    """Busy cores as whole cores, rounded down, with a core that is BUSY_FROM in use counted: 0.95 -> 1, 1.5 -> 1, 0.7 -> 0."""
    return max(0, math.floor(busy + 1.0 - BUSY_FROM + 1e-9))


def choose_threads(
    affinity: int,
    busy: Optional[float],
    given: Optional[int],
    current: int,
    local_world_size: int = 1,
    omp: Optional[str] = None,
) -> tuple[int, str]:
    """The thread count of a run, and the sentence that says why.

    Args:
        affinity: the cores this process may run on (os.sched_getaffinity).
        busy: cores in use by other processes right now, a fraction of a core included (busy_cores); None: unknown.
        given: the `threads` setting when it is a number; it is taken as is.
        current: torch's count before the run (OMP_NUM_THREADS, the program's torch.set_num_threads, or torch's default of
            one per physical core); auto never goes above it, so a user's OMP_NUM_THREADS=1 stays 1.
        local_world_size: processes of the run on this machine (torchrun's LOCAL_WORLD_SIZE): they share the free cores.
        omp: OMP_NUM_THREADS as set (None: not set), named only when it is what held torch to fewer threads.
    """
    if given is not None:
        return given, f"threads={given} as given: {_plural(given, 'thread')}"
    share = max(1, affinity // local_world_size)  # the most threads=N that makes sense here
    each = " each" if local_world_size > 1 else ""
    set_by = f"OMP_NUM_THREADS={omp}" if omp is not None else "the program's own torch.set_num_threads"
    if share <= 1:
        shared = f" for {local_world_size} processes of the run" if local_world_size > 1 else ""
        return 1, f"{_plural(affinity, 'core')} usable here (CPU affinity and quota){shared}: 1 thread{each}"
    if current <= 1:
        return 1, (
            f"torch was set to 1 thread before the run ({set_by}), and auto never goes above it: 1 thread{each}; "
            f"set threads={share} to use {_plural(share, 'core')}"
        )
    if busy is None:
        return current, (
            f"how busy the cores are cannot be read here (no /proc/stat): torch's own {_plural(current, 'thread')}{each}; "
            f"set threads=N to choose"
        )
    n_busy = counted_busy(busy)
    free = max(1, affinity - n_busy) // local_world_size
    count = max(1, min(free, current))
    said = f"{_plural(affinity, 'core')}, {n_busy} busy" + (
        f" ({busy:.2f} measured)" if abs(busy - n_busy) >= 0.05 else ""
    )
    if local_world_size > 1:
        said += f", {local_world_size} processes of the run on this machine"
    if current < max(1, free):
        said += f", torch at {current} before the run ({set_by})"
    fix = f"set threads={share} to override" if count < share else "set threads=N to choose another count"
    return count, f"{said}: {_plural(count, 'thread')}{each}; {fix}"


def resumed_threads(recorded: Any, chosen: int, reason: str, explicit: bool, cores: int = 1 << 16) -> tuple[int, str]:
    """The count a resumed run continues with: the one its checkpoint recorded (so the continuation stays bitwise equal to
    an uninterrupted run), unless `threads` was given for this start (`explicit`), when `chosen` (from choose_threads, with
    its `reason`) is kept and a change is said to break bitwise equality. A recorded count that is not a whole number
    from 1 to `cores` (a checkpoint from a larger machine, or edited) is not taken."""
    if recorded is not None and not (
        isinstance(recorded, int) and not isinstance(recorded, bool) and 1 <= recorded <= cores
    ):
        return chosen, (
            f"{reason} (the checkpoint records threads={recorded!r}, not a count from 1 to the {_plural(cores, 'core')} "
            "usable here, so the continuation is not bitwise equal to an uninterrupted run)"
        )
    if recorded is None:
        return chosen, (
            f"{reason} (the checkpoint records no thread count: with another count than the run's, the continuation is "
            "not bitwise equal to an uninterrupted run)"
        )
    if not explicit:
        now = "as auto would choose now" if chosen == recorded else f"auto would choose {chosen} now"
        return recorded, (
            f"resuming with the {_plural(recorded, 'thread')} the run recorded ({now}), so the continuation stays bitwise "
            f"equal to an uninterrupted run; set threads=N to change it"
        )
    if chosen == recorded:
        return chosen, f"{reason}, as the run recorded"
    return chosen, (
        f"{reason}, where the run recorded {recorded}: the continuation is no longer bitwise equal to an uninterrupted run"
    )


def usable_cores() -> int:
    """The cores this process may run on: its affinity where the system says, else every core; fewer under a cgroup
    CPU quota (cgroup_quota)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_quota()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def stat_ticks(text: str, cpus: Optional[set[int]]) -> Optional[tuple[int, int, int]]:
    """(busy, total, CPUs counted): clock ticks since boot summed over `cpus` (all when None) from the per-CPU lines of
    /proc/stat's `text`; None when it has none of them. Idle is idle + iowait; busy is the rest (user, nice, system, irq, softirq,
    steal; guest time is inside user)."""
    busy = total = n = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit()) or (cpus is not None and int(name[3:]) not in cpus):
            continue
        fields = rest.split()[:8]
        if len(fields) < 4 or not all(
            x.isdigit() for x in fields
        ):  # a short or garbled line (no real kernel's) counts as none
            continue
        ticks = [int(x) for x in fields]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
        busy, total, n = busy + sum(ticks) - idle, total + sum(ticks), n + 1
    return (busy, total, n) if n else None


def _cpu_times(cpus: Optional[set[int]]) -> Optional[tuple[int, int, int]]:
    """stat_ticks of /proc/stat now; None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            return stat_ticks(f.read(), cpus)
    except OSError:
        return None


def busy_cores(window_s: float = WINDOW_S) -> Optional[float]:
    """Cores of this process's affinity that other processes kept busy over the next `window_s` seconds (1.0: one whole
    core), from /proc/stat's CPU times; this process's own use in the window (its threads still spinning, say) is not
    counted. None where /proc/stat cannot be read (not Linux)."""
    try:
        cpus: Optional[set[int]] = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = None
    before, own0, t0 = _cpu_times(cpus), time.process_time(), time.perf_counter()
    if before is None:
        return None
    time.sleep(window_s)
    after, own1, t1 = _cpu_times(cpus), time.process_time(), time.perf_counter()
    if after is None or after[1] <= before[1] or after[2] != before[2]:
        return None
    machine = (after[0] - before[0]) / (after[1] - before[1]) * after[2]  # cores in use, ours included
    return max(0.0, machine - (own1 - own0) / max(t1 - t0, 1e-9))


def decide(given: Optional[int], local_world_size: int = 1) -> Threads:
    """A run's thread count: `given` as is, else choose_threads over this process's cores, torch's count now and how busy
    the cores are (measured only where the choice could be above 1)."""
    cores = usable_cores()
    if given is not None and given > cores:
        raise GcfError(
            f"threads={given} is more than the {_plural(cores, 'core')} this process may use (its CPU affinity and "
            f"quota); set threads={cores} or fewer, or threads=auto."
        )
    current = torch.get_num_threads()
    busy = busy_cores() if given is None and current > 1 else None
    count, reason = choose_threads(cores, busy, given, current, local_world_size, os.environ.get("OMP_NUM_THREADS"))
    return Threads(count, reason, busy)


def apply(count: int) -> None:
    """torch's intra-op threads to `count`, and its inter-op threads where that can still be set (only before any
    inter-op work of the process; after it torch refuses, and the inter-op pool, which a training step hardly uses, stays)."""
    torch.set_num_threads(count)
    try:
        torch.set_num_interop_threads(count)
    except RuntimeError:
        pass
