"""Ending a Lava run's process group without leaving its shared memory behind (Linux).

Standard library only: used by the ``lava`` backend (snnconv's side) and by ``worker.py`` (Lava's
side). Multiprocessing's resource tracker unlinks the shared memory a run registered once its
processes are gone, but a process stopped between creating a segment and registering it leaves
that segment in ``/dev/shm``. :func:`end_group` closes that window: it freezes the group
(SIGSTOP), notes every ``/dev/shm`` file the frozen processes have open or mapped, stops them
(SIGTERM, then SIGKILL after ``grace`` seconds) and unlinks whichever of those files is left.
"""

import os
import signal
import time

SHM = "/dev/shm/"


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, process group)`` of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2])


def _tracker(pid: int) -> bool:
    """Whether ``pid`` is a multiprocessing resource tracker (it ignores SIGTERM and exits by
    itself once every process that could register with it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return False


def members(pgid: int) -> set[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[1] == pgid and st[0] != "Z":
                found.add(int(name))
    return found


def shared_memory(pids: set[int]) -> set[str]:
    """The ``/dev/shm`` files that processes ``pids`` have open or mapped."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                found |= {line.split()[-1] for line in f if SHM in line}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM):
                    found.add(target.removesuffix(" (deleted)"))
        except OSError:  # gone meanwhile
            pass
    return found


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_group(pgid: int, grace: float = 10.0, spare: int | None = None) -> None:
    """Stop every process of group ``pgid`` except ``spare`` and the resource trackers, and
    unlink the shared memory they had. Returns once they are gone (zombies count as gone)."""
    frozen: set[int] = set()
    while True:  # freeze until no member is left running (a running one may still fork)
        todo = {p for p in members(pgid) if p != spare and not _tracker(p)} - frozen
        if not todo:
            break
        _signal(todo, signal.SIGSTOP)
        frozen |= todo
    names = shared_memory(frozen)
    _signal(frozen, signal.SIGTERM)
    _signal(frozen, signal.SIGCONT)
    deadline = time.monotonic() + grace
    while frozen & members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal(frozen & members(pgid), signal.SIGKILL)
    while frozen & members(pgid):
        time.sleep(0.05)
    for name in names:
        try:
            os.unlink(name)
        except OSError:  # unlinked by the tracker or the process itself
            pass
