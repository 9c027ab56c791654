"""What the kernel's scheduler says about a process: time on a CPU, and time runnable but kept waiting.

Pinning a benchmark's processes to cores does not keep other programs off those cores. On a shared machine
the wait is what shows how much the figures were held back by someone else's work.
"""

from __future__ import annotations

import os


def sched_seconds(pid: int, with_children: bool = True) -> tuple[float, float]:
    """Seconds on a CPU and seconds waiting on a run queue (``/proc/<pid>/task/*/schedstat``), summed over
    the threads of the process and, ``with_children``, of its children (nginx's worker is its master's
    child; a benchmark's own process leaves out the servers it started)."""
    running = waiting = 0
    for process in [pid, *(children(pid) if with_children else ())]:
        try:
            for tid in os.listdir(f"/proc/{process}/task"):
                with open(f"/proc/{process}/task/{tid}/schedstat", encoding="ascii") as stat:
                    on_cpu, queued, _ = stat.read().split()
                running, waiting = running + int(on_cpu), waiting + int(queued)
        except FileNotFoundError:  # a thread or child that just ended
            continue
    return running / 1e9, waiting / 1e9


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return found
