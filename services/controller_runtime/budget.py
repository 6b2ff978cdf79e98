"""Fair controller time: what one user's controllers may take of the runtime (pure: fed times).

The runtime runs every controller of every user in one process, and each step of the whole batch
waits for the slowest controller in it: a controller that loops until its deadline makes everybody's
step that much longer. So each user has a bucket of controller CPU time, refilled at
``controllers.user_cpu_share`` seconds per second up to ``controllers.user_cpu_burst_s`` (a share of 0: no limit), and every
call into one of the user's controllers (init, pre/mid/post_process) is charged to it, deadline
overruns included. A user whose bucket is empty gets a clear error: new controllers are refused at
instantiate, running ones fail at their next call. ``controllers.max_controlled_per_user`` caps how
many controlled requests one user has live at once.

Charges are CPU time, not wall time: the runtime runs at a lower priority beside the forward pass, and a busy
host that holds it off the CPU must not spend its users' buckets. Reading a thread's CPU clock is a system call
(about 0.6 µs, ten times a wall clock), so a main-channel call times its callbacks by the wall clock and
scales what it charges by the share of that call the runtime's thread spent on the CPU (:class:`CpuShare`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


class CpuShare:
    """The calling thread's CPU time since this object was made, and its share of the wall time since then."""

    __slots__ = ("wall_start", "cpu_start")

    def __init__(self) -> None:
        self.wall_start, self.cpu_start = time.perf_counter(), time.thread_time()

    def cpu_s(self) -> float:
        return time.thread_time() - self.cpu_start

    def wall_s(self) -> float:
        return time.perf_counter() - self.wall_start

    def share(self) -> float:
        """CPU time over wall time so far, at most 1 (1 before any time passed)."""
        wall = self.wall_s()
        return min(1.0, self.cpu_s() / wall) if wall > 0 else 1.0


class OpClock:
    """The :class:`CpuShare` of the main-channel call in progress (begun with it, on the runtime's main thread):
    a native callback past its deadline on the wall clock is judged by the CPU time of the call so far, which
    bounds its own from above and costs no clock read per callback."""

    __slots__ = ("cpu",)

    def __init__(self) -> None:
        self.cpu = CpuShare()

    def begin(self) -> CpuShare:
        self.cpu = CpuShare()
        return self.cpu


@dataclass
class _Account:
    credit_s: float
    updated: float
    live: int = 0  # controlled requests instantiated and not yet ended


class UserBudgets:
    def __init__(self, share: float, burst_s: float, max_live: int) -> None:
        self.share = share
        self.burst_s = burst_s
        self.max_live = max_live
        self._accounts: dict[str, _Account] = {}

    def _account(self, user: str, now: float) -> _Account:
        account = self._accounts.get(user)
        if account is None:
            account = self._accounts[user] = _Account(credit_s=self.burst_s, updated=now)
        account.credit_s = min(self.burst_s, account.credit_s + (now - account.updated) * self.share)
        account.updated = now
        return account

    def refusal(self, user: str, now: float) -> str:
        """Why ``user`` may not start another controlled request now ("": it may)."""
        account = self._account(user, now)
        if account.live >= self.max_live:
            return (f"user {user!r} already has {account.live} controlled requests running, the most allowed "
                    f"(controllers.max_controlled_per_user); wait for one to end")
        return self.exhausted(user, now)

    def exhausted(self, user: str, now: float) -> str:
        """Why ``user``'s controllers may not run now ("": they may). A share of 0 sets no limit."""
        account = self._account(user, now)
        if account.credit_s > 0 or self.share == 0:
            return ""
        wait = -account.credit_s / self.share
        return (f"user {user!r} used up their controller CPU time ({self.share:g} s per second, bursts of "
                f"{self.burst_s:g} s); retry in {wait:.1f} s")

    def credit_s(self, user: str, now: float) -> float:
        """What is left of ``user``'s bucket."""
        return self._account(user, now).credit_s

    def charge(self, user: str, seconds: float, now: float) -> None:
        self._account(user, now).credit_s -= seconds

    def started(self, user: str, now: float) -> None:
        self._account(user, now).live += 1

    def ended(self, user: str, now: float) -> None:
        account = self._account(user, now)
        account.live = max(0, account.live - 1)
        if account.live == 0 and account.credit_s >= self.burst_s:
            del self._accounts[user]  # nothing to remember: a full bucket is where a new user starts
