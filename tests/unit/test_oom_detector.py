"""The bounded log scanner and the safe opener: behaviour, limits, hostile input."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_colloc.config import CollocConfig
from slurm_colloc.oom import (
    DEFAULT_TAIL_BYTES,
    PATTERNS,
    open_log,
    scan_file,
    scan_files,
    tail_bytes_from_config,
)
from slurm_colloc.oom.safe_open import RefusedPath

GPU_LINE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
    "total capacity of 39.38 GiB of which 1.58 GiB is free."
)
HOST_LINE = "slurmstepd: error: Detected 1 oom_kill event in StepId=12.batch. Some of the step tasks have been OOM Killed."
MPS_LINE = "RuntimeError: CUDA error: the MPS client has been terminated by the server"
GPU_EXAMPLES = [p.example for p in PATTERNS if p.cause == "gpu-oom"]
HOST_EXAMPLES = [p.example for p in PATTERNS if p.cause == "host-oom"]

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def write(tmp_path, name: str, data: bytes | str):
    p = tmp_path / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


def test_default_tail_is_config_value() -> None:
    assert DEFAULT_TAIL_BYTES == 64 << 20
    assert tail_bytes_from_config(CollocConfig(log_scan_tail_mib=3)) == 3 << 20


def test_gpu_oom_with_context(tmp_path) -> None:
    body = (
        'step 1\nTraceback (most recent call last):\n  File "t.py", line 1\n' + GPU_LINE + "\nbye\n"
    )
    r = scan_file(write(tmp_path, "o", body))
    assert (r.status, r.cause, r.pattern_id) == ("ok", "gpu-oom", "torch-cuda-oom")
    assert r.evidence.line == GPU_LINE
    assert r.evidence.before == (
        "step 1",
        "Traceback (most recent call last):",
        '  File "t.py", line 1',
    )
    assert r.evidence.after == ("bye",)
    assert r.evidence.offset == body.index(GPU_LINE)
    assert r.complete


def test_no_oom(tmp_path) -> None:
    r = scan_file(write(tmp_path, "o", "all fine\n" * 1000))
    assert (r.status, r.cause, r.evidence) == ("ok", "none", None)


def test_empty_file(tmp_path) -> None:
    r = scan_file(write(tmp_path, "o", b""))
    assert (r.status, r.cause, r.file_size) == ("ok", "none", 0)


def test_missing_file(tmp_path) -> None:
    r = scan_file(tmp_path / "nope")
    assert (r.status, r.cause) == ("missing", "none")


def test_priority_gpu_over_host_and_also_seen(tmp_path) -> None:
    r = scan_file(write(tmp_path, "o", f"{GPU_LINE}\nx\n{HOST_LINE}\n"))
    assert r.cause == "gpu-oom"
    assert [e.cause for e in r.also_seen] == ["host-oom"]


def test_mps_fault_over_host(tmp_path) -> None:
    r = scan_file(write(tmp_path, "o", f"{MPS_LINE}\n{HOST_LINE}\n"))
    assert (r.cause, r.pattern_id) == ("mps-fault", "mps-client-terminated")


def test_latest_gpu_line_is_evidence(tmp_path) -> None:
    first = "RuntimeError: CUDA error: out of memory"
    r = scan_file(write(tmp_path, "o", f"{first}\nnoise\n{GPU_LINE}\n"))
    assert r.pattern_id == "torch-cuda-oom"


def test_oom_before_tail_is_not_seen(tmp_path) -> None:
    p = write(tmp_path, "o", GPU_LINE + "\n" + "x" * 99 + "\n" * 5000)
    r = scan_file(p, tail_bytes=4096)
    assert r.cause == "none" and not r.complete and r.bytes_scanned <= 4096


def test_oom_across_chunk_boundaries(tmp_path) -> None:
    for pad in range(0, 300, 37):
        p = write(tmp_path, f"o{pad}", "a" * pad + "\n" + GPU_LINE + "\n" + "b\n" * 40)
        r = scan_file(p, chunk_bytes=64, max_line_bytes=512)
        assert r.cause == "gpu-oom", pad


def test_max_lines_per_file(tmp_path) -> None:
    p = write(tmp_path, "o", GPU_LINE + "\n" + "ok\n" * 10)
    assert scan_file(p, max_lines_per_file=5).cause == "none"
    assert scan_file(p, max_lines_per_file=11).cause == "gpu-oom"


def test_giant_single_line(tmp_path) -> None:
    p = tmp_path / "giant"
    with open(p, "wb") as f:
        f.write(b"z" * (8 << 20))
        f.write(GPU_LINE.encode())
        f.write(b"z" * (1 << 20))
    r = scan_file(p, chunk_bytes=1 << 20)
    assert r.cause == "gpu-oom"
    assert len(r.evidence.line) <= 600  # capped for the report


def test_adversarial_needle_flood_is_bounded(tmp_path) -> None:
    p = write(tmp_path, "o", b"OOM when allocating " * 200_000)  # ~4 MB of needles, one line
    r = scan_file(p)
    assert r.status == "ok"  # classified (tf-oom) or not, but it returns


def test_binary_garbage_and_invalid_utf8(tmp_path) -> None:
    data = (
        os.urandom(100_000) + b"\xff\xfe" + GPU_LINE.encode() + b"\x00\x1b[31m\n" + os.urandom(1000)
    )
    r = scan_file(write(tmp_path, "o", data))
    assert r.cause == "gpu-oom"
    assert all(c.isprintable() or c == "\t" for c in r.evidence.line)


def test_refuses_symlink(tmp_path) -> None:
    target = write(tmp_path, "secret", GPU_LINE)
    link = tmp_path / "log"
    link.symlink_to(target)
    r = scan_file(link)
    assert (r.status, r.cause) == ("refused", "none")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a symlink as another user")
def test_refuses_user_symlink_in_parent(tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    write(real, "o", GPU_LINE)
    link = tmp_path / "dirlink"
    link.symlink_to(real)
    os.lchown(link, 65534, 65534)
    r = scan_file(link / "o")
    assert r.status == "refused" and "symlink" in r.error


def test_root_owned_symlink_in_parent_is_followed(tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    write(real, "o", GPU_LINE)
    link = tmp_path / "dirlink"
    link.symlink_to(real)
    if os.lstat(link).st_uid != 0:
        pytest.skip("symlink not root-owned when not running as root")
    assert scan_file(link / "o").cause == "gpu-oom"


def test_refuses_fifo_without_blocking(tmp_path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = scan_file(fifo)
    assert r.status == "refused" and "regular" in r.error


def test_refuses_device_and_directory(tmp_path) -> None:
    assert scan_file("/dev/null").status == "refused"
    assert scan_file(tmp_path).status == "refused"


def test_relative_path_refused() -> None:
    with pytest.raises(RefusedPath):
        open_log("relative/log")
    assert scan_file("relative/log").status == "refused"


def test_wrong_owner_refused(tmp_path) -> None:
    p = write(tmp_path, "o", GPU_LINE)
    r = scan_file(p, uid=os.geteuid() + 12345, gid=os.getegid())
    assert r.status in ("refused", "unreadable")


@pytest.mark.skipif(os.geteuid() != 0, reason="privilege drop needs root")
def test_open_as_user_enforces_user_rights() -> None:
    import pathlib
    import shutil
    import tempfile

    top = pathlib.Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is 0700 root
    os.chmod(top, 0o755)
    try:
        _check_user_rights(top)
    finally:
        shutil.rmtree(top)


def _check_user_rights(top) -> None:
    d = top / "private"
    d.mkdir(mode=0o700)
    p = write(d, "o", GPU_LINE)
    os.chown(p, 65534, 65534)  # owned by nobody, but inside a root-only directory
    r = scan_file(p, uid=65534, gid=65534)
    assert r.status == "unreadable" and r.cause == "none"
    os.chmod(d, 0o755)
    r = scan_file(p, uid=65534, gid=65534)
    assert r.cause == "gpu-oom"
    assert os.geteuid() == 0 and os.getegid() == 0  # root restored


def test_unreadable_file(tmp_path) -> None:
    """A mode-0 log is unreadable: as root, read as the file's unprivileged owner."""
    import shutil
    import tempfile

    top = tmp_path
    if os.geteuid() == 0:  # root reads everything: scan as nobody, in a dir nobody can enter
        top = Path(tempfile.mkdtemp(dir="/tmp"))
        os.chmod(top, 0o755)
    try:
        p = write(top, "o", GPU_LINE)
        os.chmod(p, 0)
        if os.geteuid() == 0:
            os.chown(p, 65534, 65534)
            r = scan_file(p, uid=65534, gid=65534)
        else:
            r = scan_file(p)
        assert r.status == "unreadable"
    finally:
        if top != tmp_path:
            shutil.rmtree(top)


def test_scan_files_picks_highest_cause_and_skips_dupes(tmp_path) -> None:
    err = write(tmp_path, "err", HOST_LINE + "\n")
    out = write(tmp_path, "out", GPU_LINE + "\n")
    s = scan_files([err, None, str(err), out, tmp_path / "missing"])
    assert s.cause == "gpu-oom" and s.evidence_path == str(out)
    assert [r.status for r in s.results] == ["ok", "ok", "missing"]
    assert s.to_dict()["pattern_id"] == "torch-cuda-oom"


def test_scan_files_nothing() -> None:
    s = scan_files([])
    assert (s.cause, s.evidence, s.evidence_path) == ("none", None, None)


# ---------------------------------------------------------------- properties ---

noise_line = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"), max_size=120
).filter(lambda s: not any(p.regex.search(s.encode()) for p in PATTERNS))


@SETTINGS
@given(
    before=st.lists(noise_line, max_size=40),
    after=st.lists(noise_line, max_size=40),
    example=st.sampled_from(GPU_EXAMPLES),
    chunk=st.integers(64, 4096),
)
def test_gpu_line_anywhere_in_tail_is_found(tmp_path, before, after, example, chunk) -> None:
    text = "\n".join([*before, example, *after]) + "\n"
    p = write(tmp_path, "h", text)
    r = scan_file(p, chunk_bytes=chunk, max_line_bytes=1024)
    assert r.cause == "gpu-oom"
    assert r.evidence.offset == len("\n".join(before).encode()) + (1 if before else 0)


@SETTINGS
@given(lines=st.lists(st.one_of(noise_line, st.sampled_from(HOST_EXAMPLES)), max_size=60))
def test_host_oom_never_gpu(tmp_path, lines) -> None:
    r = scan_file(write(tmp_path, "h", "\n".join(lines)), chunk_bytes=128, max_line_bytes=1024)
    assert r.cause in ("none", "host-oom")
    if any(x in HOST_EXAMPLES for x in lines):
        assert r.cause == "host-oom"


@SETTINGS
@given(
    data=st.binary(max_size=20_000),
    chunk=st.integers(1, 5000),
    line=st.integers(1, 3000),
    tail=st.integers(1, 30_000),
    max_lines=st.one_of(st.none(), st.integers(0, 50)),
)
def test_arbitrary_bytes_never_crash(tmp_path, data, chunk, line, tail, max_lines) -> None:
    r = scan_file(
        write(tmp_path, "b", data),
        chunk_bytes=chunk,
        max_line_bytes=line,
        tail_bytes=tail,
        max_lines_per_file=max_lines,
    )
    assert r.status == "ok"
    assert r.bytes_scanned <= min(tail, len(data))
    r.to_dict()


def test_stat_mode_of_result_file_untouched(tmp_path) -> None:
    p = write(tmp_path, "o", GPU_LINE)
    before = os.stat(p)
    scan_file(p)
    after = os.stat(p)
    assert stat.S_IMODE(before.st_mode) == stat.S_IMODE(after.st_mode)
    assert before.st_size == after.st_size


# ------------------------------------------------------------ issue 11, Low ---


def test_low_open_log_uses_primary_gid_and_groups(tmp_path, monkeypatch) -> None:
    """Low (issue 11): without an explicit gid the log is opened with the user's primary
    gid from passwd and the user's supplementary groups, never with gid = uid."""
    import pwd as pwdmod

    import slurm_colloc.oom.safe_open as so

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(so.os, "geteuid", lambda: 0)
    monkeypatch.setattr(so.os, "getgroups", lambda: [0])
    monkeypatch.setattr(so.os, "setgroups", lambda g: calls.append(("setgroups", list(g))))
    monkeypatch.setattr(so.os, "setegid", lambda g: calls.append(("setegid", g)))
    monkeypatch.setattr(so.os, "seteuid", lambda u: calls.append(("seteuid", u)))
    monkeypatch.setattr(so.os, "getgrouplist", lambda name, g: [g, 300, 301])
    fake = pwdmod.struct_passwd(("fakeuser", "x", 1234, 4321, "", "/home/f", "/bin/sh"))
    monkeypatch.setattr(so.pwd, "getpwuid", lambda uid: fake if uid == 1234 else None)
    monkeypatch.setattr(so, "_open_checked", lambda path, uid: 42)
    assert so.open_log("/some/log", uid=1234) == 42
    assert ("setegid", 4321) in calls and ("setegid", 1234) not in calls
    assert ("setgroups", [4321, 300, 301]) in calls
    assert ("seteuid", 1234) in calls and calls[-1] == ("setgroups", [0])


def test_low_unknown_user_without_gid_is_refused(monkeypatch) -> None:
    """Low: a uid with no passwd entry and no gid given gets no guessed group."""
    import slurm_colloc.oom.safe_open as so

    def nouser(uid: int) -> None:
        raise KeyError(uid)

    monkeypatch.setattr(so.os, "geteuid", lambda: 0)
    monkeypatch.setattr(so.pwd, "getpwuid", nouser)
    monkeypatch.setattr(so, "_open_checked", lambda path, uid: 42)
    with pytest.raises(RefusedPath):
        so.open_log("/some/log", uid=987654)


def _timed_scan(path, **kw):
    import time

    t0 = time.monotonic()
    r = scan_file(path, **kw)
    return r, time.monotonic() - t0


def test_low_hundred_mib_line_without_newline(tmp_path) -> None:
    """Low: one 100 MiB line with no newline is scanned within the configured tail, in
    bounded time, and an OOM message at its end is still found."""
    p = tmp_path / "big"
    with open(p, "wb") as f:
        block = b"x" * (1 << 20)
        for _ in range(100):
            f.write(block)
        f.write(GPU_LINE.encode())
    r, dt = _timed_scan(p)
    assert r.cause == "gpu-oom" and r.status == "ok"
    assert r.bytes_scanned <= DEFAULT_TAIL_BYTES and not r.complete
    assert len(r.evidence.line) <= 600 and dt < 20
    with open(p, "r+b") as f:  # the same without any message: whole tail, bounded
        f.truncate(100 << 20)
    r, dt = _timed_scan(p, tail_bytes=8 << 20)
    assert r.cause == "none" and r.bytes_scanned <= 8 << 20 and dt < 20


def test_low_nul_bytes_and_invalid_utf8(tmp_path) -> None:
    """Low: a sparse file of NULs, and NUL/invalid UTF-8 around an OOM line."""
    p = tmp_path / "sparse"
    with open(p, "wb") as f:
        f.truncate(200 << 20)
    r, dt = _timed_scan(p)
    assert r.cause == "none" and r.bytes_scanned <= DEFAULT_TAIL_BYTES and dt < 20
    q = write(tmp_path, "mixed", b"\x00" * 70000 + b"\xc3\x28\xa0\xa1" + GPU_LINE.encode()
              + b"\x00\xff\n" + b"\xed\xa0\x80" * 1000)
    r = scan_file(q, tail_bytes=1 << 20)
    assert r.cause == "gpu-oom"
    assert "\x00" not in r.evidence.line and r.evidence.line.isprintable()
