"""Issue 23, item 4: the estimator history's published snapshot was 0644 and listed
every user's uid, model fingerprints, batch sizes and job ids.

Now the full snapshot is root's (0600) and each user reads a snapshot of their own
rows only, readable by them (and root) and nobody else. Run as root with the system
users ``colloc-u1`` and ``colloc-u2``.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sqlite3
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.estimators import SqliteHistory
from slurm_colloc.node.as_user import AsUserError, Credentials, run_as_user

FP = "ab" * 16


@pytest.fixture
def db() -> Iterator[Path]:
    """A history database in a directory users can traverse."""
    d = Path(tempfile.mkdtemp(prefix="colloc-hist-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d / "history.sqlite"
    shutil.rmtree(d, ignore_errors=True)


def _as(user: pwd.struct_passwd, gid: int | None = None) -> Credentials:
    g = user.pw_gid if gid is None else gid
    return Credentials(user.pw_uid, g, (g,))


def _peaks_as(creds: Credentials, db: Path, uid: int) -> dict[str, int]:
    def action() -> str:
        got = SqliteHistory(db, uid=uid).peaks(FP, None, "adam", "fp32")
        return json.dumps({str(k): v for k, v in got.items()})

    return dict(json.loads(run_as_user(creds, action, timeout_s=20)))


def _open_as(creds: Credentials, path: Path) -> str:
    def action() -> str:
        with open(path, "rb") as f:
            return f.read(16).decode("latin-1")

    try:
        return run_as_user(creds, action, timeout_s=10)
    except AsUserError as e:
        return f"refused: {e}"


def _record(db: Path) -> tuple[pwd.struct_passwd, pwd.struct_passwd]:
    u1, u2 = pwd.getpwnam("colloc-u1"), pwd.getpwnam("colloc-u2")
    SqliteHistory(db).record(FP, 8, None, "adam", "fp32", 900, uid=u1.pw_uid, job_id="11")
    SqliteHistory(db).record(FP, 16, None, "adam", "fp32", 3000, uid=u2.pw_uid, job_id="22")
    return u1, u2


def test_full_snapshot_is_root_only(db: Path) -> None:
    u1, _ = _record(db)
    st = os.stat(db)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
    assert _open_as(_as(u1), db).startswith("refused")
    # root (an admin, the demo) still reads everything there
    assert SqliteHistory(db, uid=u1.pw_uid).peaks(FP, None, "adam", "fp32") == {8: 900}


def test_a_user_reads_their_own_history(db: Path) -> None:
    u1, u2 = _record(db)
    assert _peaks_as(_as(u1), db, u1.pw_uid) == {"8": 900}
    assert _peaks_as(_as(u2), db, u2.pw_uid) == {"16": 3000}


def test_a_user_cannot_read_another_users_history(db: Path) -> None:
    """Not through the API, not through the file, not via a shared primary group."""
    u1, u2 = _record(db)
    assert _peaks_as(_as(u1), db, u2.pw_uid) == {}
    theirs = SqliteHistory(db, uid=u2.pw_uid).user_snapshot_path()
    assert theirs.is_file()
    assert _open_as(_as(u1), theirs).startswith("refused")
    assert _open_as(_as(u1, gid=u2.pw_gid), theirs).startswith("refused")
    assert _open_as(_as(u2), theirs).startswith("SQLite format 3")


def test_own_snapshot_holds_only_own_rows(db: Path) -> None:
    u1, _ = _record(db)
    mine = SqliteHistory(db, uid=u1.pw_uid).user_snapshot_path()
    con = sqlite3.connect(f"file:{mine}?mode=ro", uri=True)
    try:
        uids = {r[0] for r in con.execute("SELECT uid FROM peaks_v2")}
    finally:
        con.close()
    assert uids == {u1.pw_uid}
    st = os.stat(mine)
    assert (st.st_uid, st.st_gid) == (0, 0) and not st.st_mode & 0o027
    # the directory is traversable, not listable: who has history is not public
    assert stat.S_IMODE(os.stat(mine.parent).st_mode) == 0o711


def test_snapshots_of_an_older_release_are_split_on_first_write(db: Path) -> None:
    """A node upgraded with history in it: the first record publishes every user's
    own snapshot, not only the recording user's."""
    u1, u2 = pwd.getpwnam("colloc-u1"), pwd.getpwnam("colloc-u2")
    SqliteHistory(db).record(FP, 16, None, "adam", "fp32", 3000, uid=u2.pw_uid, job_id="22")
    shutil.rmtree(SqliteHistory(db).user_snapshot_path().parent)  # the old layout
    SqliteHistory(db).record(FP, 8, None, "adam", "fp32", 900, uid=u1.pw_uid, job_id="11")
    assert _peaks_as(_as(u2), db, u2.pw_uid) == {"16": 3000}
