"""A worker group's wake-up: a POSIX semaphore rank 0 posts each time it shares a step.

MLX's collectives wait by polling (the ring backend spins on its sockets), so a rank k > 0 waiting
for an idle rank 0's next step burned a core. With every rank on this machine, the orchestrator
makes a semaphore (`create`: owner-only, an unguessable name); rank 0 posts it once per other rank
as it shares each step (`Wake.post`), and the others wait on it in the OS (`Wake.wait`) before they
read that step, so they enter the collective only once rank 0 is there. Ranks on other hosts have
none and poll as before. The orchestrator unlinks the name once the group is ready (every rank has
opened it) or has failed: the semaphore lives on in the open handles, and no name is left behind.

Written by hand: MLX's distributed API has no blocking wait, and `posix_ipc` is the project's
shared-memory library already.
"""

from __future__ import annotations

import secrets

import posix_ipc

#: Where sem_timedwait is missing (macOS), posix_ipc waits without a limit: the rank's watchdog
#: still ends a rank that waits longer than its collective timeout.
TIMED_WAIT = bool(getattr(posix_ipc, "SEMAPHORE_TIMEOUT_SUPPORTED", False))


def create() -> str:
    """A new semaphore, readable and writable by this user only, at 0; returns its name."""
    name = f"/mlxrt-wake-{secrets.token_hex(12)}"
    posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0).close()
    return name


def unlink(name: str) -> None:
    """Remove the name (handles already open keep working); gone already is no error."""
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass


class Wake:
    """One rank's handle on the group's semaphore."""

    def __init__(self, name: str) -> None:
        self._sem = posix_ipc.Semaphore(name)

    def post(self, n: int) -> None:
        """Rank 0 shares a step: wake each of the `n` other ranks once."""
        for _ in range(n):
            self._sem.release()

    def wait(self, timeout_s: float) -> bool:
        """Rank k > 0: wait in the OS until rank 0 has shared its next step, at most `timeout_s`
        (no limit where the platform has no timed wait); False if the time ran out."""
        try:
            self._sem.acquire(timeout_s if TIMED_WAIT else None)
        except posix_ipc.BusyError:
            return False
        return True
