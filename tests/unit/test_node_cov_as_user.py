"""slurm_colloc.node.as_user: the checks that make the child the user for good, the
child's answer protocol, and the parent's error paths (pipe, fork, a child that dies,
one that never exits).

Coverage does not see code after ``os.fork`` in the child (it leaves with ``os._exit``,
and a child that became the job's user cannot write the parent's data file), so the
child-side functions (:func:`drop_privileges`, :func:`_child`) are also driven here
in-process, with the system calls replaced by fakes that can lie: the point is that a
lie is caught, not that the kernel works.
"""

from __future__ import annotations

import os
import pwd
import signal
import time
from typing import Any

import pytest

from slurm_colloc.node import as_user
from slurm_colloc.node.as_user import AsUserError, Credentials

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (forks a root child)")


class FakeOs:
    """The system calls drop_privileges makes, as root; each can be made to lie."""

    def __init__(self, *, uids: tuple[int, int, int] | None = None,
                 gids: tuple[int, int, int] | None = None, groups: list[int] | None = None,
                 regain: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self._uids = uids
        self._gids = gids
        self._groups = groups
        self.regain = regain
        self.state = {"uid": (0, 0, 0), "gid": (0, 0, 0), "groups": [0]}

    def geteuid(self) -> int:
        return self.state["uid"][1]

    def setgroups(self, groups: list[int]) -> None:
        self.calls.append(("setgroups", list(groups)))
        self.state["groups"] = list(groups)

    def setresgid(self, r: int, e: int, s: int) -> None:
        self.calls.append(("setresgid", (r, e, s)))
        self.state["gid"] = (r, e, s)

    def setresuid(self, r: int, e: int, s: int) -> None:
        self.calls.append(("setresuid", (r, e, s)))
        if self.state["uid"] != (0, 0, 0) and not self.regain:
            raise PermissionError(1, "Operation not permitted")
        self.state["uid"] = (r, e, s)

    def getresuid(self) -> tuple[int, int, int]:
        return self._uids or self.state["uid"]

    def getresgid(self) -> tuple[int, int, int]:
        return self._gids or self.state["gid"]

    def getgroups(self) -> list[int]:
        return self._groups if self._groups is not None else self.state["groups"]


class FakeLibc:
    def __init__(self, dumpable_after: int = 0) -> None:
        self.dumpable_after = dumpable_after
        self.calls: list[tuple[int, ...]] = []

    def prctl(self, option: int, *args: int) -> int:
        self.calls.append((option, *args))
        if option == as_user._PR_GET_DUMPABLE:
            return self.dumpable_after
        return 0


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    def install(fos: FakeOs, libc: FakeLibc | None = None) -> tuple[FakeOs, FakeLibc]:
        libc = libc or FakeLibc()
        for name in ("geteuid", "setgroups", "setresgid", "setresuid", "getresuid",
                     "getresgid", "getgroups"):
            monkeypatch.setattr(as_user.os, name, getattr(fos, name))

        class Ctypes:
            @staticmethod
            def CDLL(name: Any, use_errno: bool = False) -> FakeLibc:
                assert name is None and use_errno
                return libc

        monkeypatch.setattr(as_user, "ctypes", Ctypes)
        return fos, libc

    return install


U = Credentials(uid=1001, gid=1001, groups=(1001, 27))


def test_drop_order_groups_then_gids_then_uids(fake) -> None:
    fos, libc = fake(FakeOs())
    as_user.drop_privileges(U)
    assert [c[0] for c in fos.calls] == ["setgroups", "setresgid", "setresuid", "setresuid"]
    assert fos.calls[0] == ("setgroups", [1001, 27])
    assert fos.calls[1] == ("setresgid", (1001, 1001, 1001))
    assert fos.calls[2] == ("setresuid", (1001, 1001, 1001))
    assert fos.calls[3] == ("setresuid", (0, 0, 0))  # the regain probe, refused
    assert (as_user._PR_SET_DUMPABLE, 0, 0, 0, 0) in libc.calls


@pytest.mark.parametrize(
    ("fos", "libc", "match"),
    [
        (FakeOs(uids=(1001, 1001, 0)), None, r"credentials not dropped: uids \(1001, 1001, 0\)"),
        (FakeOs(gids=(1001, 0, 1001)), None, "credentials not dropped"),
        (FakeOs(groups=[1001, 27, 0]), None, r"groups not dropped: \[1001, 27, 0\]"),
        (FakeOs(groups=[1001]), None, "groups not dropped"),
        (FakeOs(), FakeLibc(dumpable_after=1), "still dumpable"),
        (FakeOs(regain=True), None, "root could be regained"),
    ],
    ids=["saved-uid-0", "egid-0", "extra-group-0", "missing-group", "dumpable", "regain"],
)
def test_a_lying_kernel_is_caught(fake, fos, libc, match) -> None:
    """Each check after the drop refuses to go on when the result is not exactly the
    user's (saved uid left at 0, root's group kept, still dumpable, root regained)."""
    fake(fos, libc)
    with pytest.raises(AsUserError, match=match):
        as_user.drop_privileges(U)


def test_groups_compare_as_sets(fake) -> None:
    """The kernel may return the groups in another order or with the gid repeated."""
    fake(FakeOs(groups=[27, 1001, 27]))
    as_user.drop_privileges(U)


def test_root_job_skips_the_regain_probe(fake) -> None:
    """A job of uid 0 stays root (nothing to regain); the other checks still run."""
    fos, _ = fake(FakeOs())
    as_user.drop_privileges(Credentials(0, 0, (0,)))
    assert [c[0] for c in fos.calls] == ["setgroups", "setresgid", "setresuid"]


def test_not_root_only_as_oneself(monkeypatch) -> None:
    monkeypatch.setattr(as_user.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(as_user.os, "getuid", lambda: 1000)
    monkeypatch.setattr(as_user.os, "getgid", lambda: 100)
    monkeypatch.setattr(as_user.os, "setgroups",
                        lambda g: pytest.fail("a non-root process changes no credentials"))
    as_user.drop_privileges(Credentials(1000, 100, (100,)))
    with pytest.raises(AsUserError, match="not root: cannot become uid 1001/gid 100"):
        as_user.drop_privileges(Credentials(1001, 100, ()))
    with pytest.raises(AsUserError, match="not root"):
        as_user.drop_privileges(Credentials(1000, 0, ()))


def test_credentials_of_a_known_and_an_unknown_uid(monkeypatch) -> None:
    me = pwd.getpwuid(os.getuid())
    creds = as_user.credentials(me.pw_uid, me.pw_gid)
    assert creds.uid == me.pw_uid and creds.gid == me.pw_gid
    assert me.pw_gid in creds.groups  # getgrouplist includes the primary gid
    assert set(creds.groups) == set(os.getgrouplist(me.pw_name, me.pw_gid))
    unknown = as_user.credentials(54321, 54321)
    assert unknown == Credentials(54321, 54321, ())  # not root's groups

    def broken(name: str, gid: int) -> list[int]:
        raise OSError("NSS down")

    monkeypatch.setattr(as_user.os, "getgrouplist", broken)
    assert as_user.credentials(me.pw_uid, me.pw_gid).groups == ()


# ----------------------------------------------------- the child's answer ---


def _answer(creds: Credentials, action: Any, monkeypatch, drop: Any = None) -> tuple[int, bytes]:
    monkeypatch.setattr(as_user, "drop_privileges", drop or (lambda c: None))
    r, w = os.pipe()
    try:
        code = as_user._child(creds, action, w)
        os.close(w)
        return code, os.read(r, 1 << 16)
    finally:
        os.close(r)


def test_child_answers_ok_with_the_actions_result(monkeypatch) -> None:
    code, data = _answer(U, lambda: "/home/u/copy.txt", monkeypatch)
    assert (code, data) == (0, b"ok\n/home/u/copy.txt")


def test_child_does_not_act_when_the_drop_fails(monkeypatch) -> None:
    acted: list[bool] = []

    def drop(c: Credentials) -> None:
        raise AsUserError("groups not dropped: [0]")

    code, data = _answer(U, lambda: acted.append(True) or "x", monkeypatch, drop)
    assert acted == []
    assert (code, data) == (1, b"error\nAsUserError: groups not dropped: [0]")


def test_child_reports_any_exception_even_base_exceptions(monkeypatch) -> None:
    def action() -> str:
        raise KeyboardInterrupt("stop")

    assert _answer(U, action, monkeypatch) == (1, b"error\nKeyboardInterrupt: stop")


def test_child_answer_is_bounded_and_encodable(monkeypatch) -> None:
    code, data = _answer(U, lambda: "\udcff" + "x" * 10000, monkeypatch)
    assert code == 0 and len(data) == as_user.MAX_ANSWER_BYTES
    assert data.startswith(b"ok\n?x")  # a lone surrogate is replaced, not an error


# ------------------------------------------------------- the parent side ---


ME = Credentials(os.getuid(), os.getgid(), tuple(os.getgroups()))


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_pipe_failure_is_an_as_user_error(monkeypatch) -> None:
    def no_pipe(flags: int) -> tuple[int, int]:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(as_user.os, "pipe2", no_pipe)
    with pytest.raises(AsUserError, match=r"pipe: .*Too many open files"):
        as_user.run_as_user(ME, lambda: "x", timeout_s=1)


def test_fork_failure_closes_the_pipe(monkeypatch) -> None:
    def no_fork() -> int:
        raise OSError(11, "Resource temporarily unavailable")

    before = _open_fds()
    monkeypatch.setattr(as_user.os, "fork", no_fork)
    with pytest.raises(AsUserError, match=r"fork: .*Resource temporarily unavailable"):
        as_user.run_as_user(ME, lambda: "x", timeout_s=1)
    assert _open_fds() == before


@root_only
def test_round_trip_as_root_to_root() -> None:
    """A uid-0 job's action runs in a child that went through the whole drop."""
    creds = as_user.credentials(0, 0)
    before = _open_fds()
    got = as_user.run_as_user(creds, lambda: f"{os.getresuid()} {os.getpid()}", timeout_s=10)
    uids, pid = got.rsplit(" ", 1)
    assert uids == "(0, 0, 0)" and int(pid) != os.getpid()
    assert _open_fds() == before  # both pipe ends closed in the parent


@root_only
def test_child_that_dies_without_answer(procs) -> None:
    def die() -> str:
        os.kill(os.getpid(), signal.SIGKILL)
        return "never"

    with pytest.raises(AsUserError, match="the child died without an answer"):
        as_user.run_as_user(as_user.credentials(0, 0), die, timeout_s=10)


@root_only
def test_long_answer_is_cut(procs) -> None:
    got = as_user.run_as_user(as_user.credentials(0, 0), lambda: "é" * 5000, timeout_s=10)
    # 4096 bytes with "ok\n": 2046 two-byte characters and half of the next, replaced
    assert got == "é" * 2046 + "\ufffd"


@root_only
def test_error_answer_becomes_as_user_error_not_timeout() -> None:
    with pytest.raises(AsUserError, match="ZeroDivisionError") as ei:
        as_user.run_as_user(as_user.credentials(0, 0), lambda: str(1 // 0), timeout_s=10)
    assert not isinstance(ei.value, as_user.AsUserTimeout)


@root_only
def test_child_that_answers_but_does_not_exit_is_killed(monkeypatch) -> None:
    """The answer arrived but the child is still there when the reap deadline passes:
    it is killed, and the answer still counts."""
    real_reap = as_user._reap
    reaps: list[float] = []

    def slow_reap(pid: int, deadline: float) -> bool:
        reaps.append(deadline)
        if len(reaps) == 1:
            return False  # "still running"
        return real_reap(pid, deadline)

    killed: list[tuple[int, int]] = []
    real_kill = as_user.os.kill

    def kill(pid: int, sig: int) -> None:
        killed.append((pid, sig))
        real_kill(pid, sig)

    monkeypatch.setattr(as_user, "_reap", slow_reap)
    monkeypatch.setattr(as_user.os, "kill", kill)
    assert as_user.run_as_user(as_user.credentials(0, 0), lambda: "done", timeout_s=10) == "done"
    assert len(reaps) == 2 and [s for _, s in killed] == [signal.SIGKILL]


def test_timeout_kills_and_reports(monkeypatch) -> None:
    """The deadline: no answer in time, the child is killed (SIGKILL) and reaped."""
    t0 = time.monotonic()
    with pytest.raises(as_user.AsUserTimeout, match=r"no answer within 0.3 s: killed"):
        as_user.run_as_user(ME, lambda: time.sleep(30) or "late", timeout_s=0.3)
    assert time.monotonic() - t0 < 5


def test_reap_of_an_already_reaped_child(monkeypatch) -> None:
    def gone(pid: int, flags: int) -> tuple[int, int]:
        raise ChildProcessError(10, "No child processes")

    monkeypatch.setattr(as_user.os, "waitpid", gone)
    assert as_user._reap(12345, time.monotonic() + 1) is True


def test_reap_gives_up_at_the_deadline(monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(as_user.os, "waitpid", lambda pid, flags: calls.append(pid) or (0, 0))
    t0 = time.monotonic()
    assert as_user._reap(12345, t0 + 0.05) is False
    assert len(calls) >= 2 and time.monotonic() - t0 < 2


def test_kill_of_a_vanished_child(monkeypatch) -> None:
    def vanished(pid: int, sig: int) -> None:
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(as_user.os, "kill", vanished)
    monkeypatch.setattr(as_user, "_reap", lambda pid, deadline: True)
    as_user._kill(12345)  # no exception
