"""colloc's TaskProlog runs the site's own (chain_task_prolog): its Slurm lines are
passed on before colloc's, its exit status is the task prolog's, and only a root-owned
script no one else may write is run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import chain
from slurm_colloc.node.task_entry import task_prolog_main

LIMITED = {"CUDA_MPS_PIPE_DIRECTORY": "/run/x/pipe", "COLLOC_LIMIT_MIB": "6144"}


def _script(d: Path, body: str, name: str = "site-task-prolog") -> Path:
    p = d / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)
    return p


@pytest.fixture
def site_dir(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.fail("the trust check needs root-owned files: run the unit tests as root")
    d = tmp_path / "site"
    d.mkdir(mode=0o755)
    return d


def test_slurm_lines_pass_through_unchanged_and_others_are_dropped() -> None:
    out = "export A=1 2\nunset B\nprint hello there\nnoise\nexporting=x\n  export C=3\n"
    assert chain.slurm_lines(out) == ("export A=1 2", "unset B", "print hello there")


def test_exit_status_keeps_slurms_meaning() -> None:
    assert chain.exit_status(0) == 0
    assert chain.exit_status(3) == 3
    assert chain.exit_status(-15) == 143  # killed by SIGTERM: non-zero, as a shell says


def test_site_script_output_and_status(site_dir: Path) -> None:
    p = _script(site_dir, 'echo "export SITE_SCRATCH=/scratch/$SLURM_JOB_ID"\n'
                          "echo junk\necho 'unset LD_PRELOAD'\necho 'print site says hi'\n"
                          "exit 3")
    r = chain.run_site_task_prolog(str(p), {"SLURM_JOB_ID": "7", "PATH": "/usr/bin:/bin"})
    assert r.lines == ("export SITE_SCRATCH=/scratch/7", "unset LD_PRELOAD",
                       "print site says hi")
    assert r.status == 3
    assert r.exported() == {"SITE_SCRATCH": "/scratch/7"}


def test_killed_site_script_fails(site_dir: Path) -> None:
    p = _script(site_dir, "echo 'export X=1'\nkill -TERM $$")
    r = chain.run_site_task_prolog(str(p), {"PATH": "/usr/bin:/bin"})
    assert r.status == 143 and r.lines == ("export X=1",)


@pytest.mark.parametrize("spoil", ["file_mode", "dir_mode", "file_owner", "missing",
                                   "relative", "not_executable"])
def test_untrusted_or_missing_script_is_not_run_and_fails_the_task(
    site_dir: Path, tmp_path: Path, spoil: str
) -> None:
    marker = tmp_path / "ran"
    p = _script(site_dir, f"touch {marker}")
    path = str(p)
    if spoil == "file_mode":
        p.chmod(0o777)
    elif spoil == "dir_mode":
        site_dir.chmod(0o777)
    elif spoil == "file_owner":
        os.chown(p, 65534, 65534)
    elif spoil == "missing":
        path = str(site_dir / "nope")
    elif spoil == "relative":
        path = "site-task-prolog"
    else:
        p.chmod(0o644)
    r = chain.run_site_task_prolog(path, {"PATH": "/usr/bin:/bin"})
    assert r.status == chain.CANNOT_RUN
    assert len(r.lines) == 1 and r.lines[0].startswith("print colloc: the site's task prolog")
    assert not marker.exists()


def test_link_to_a_users_file_is_refused(site_dir: Path, tmp_path: Path) -> None:
    users = tmp_path / "users"
    users.mkdir(mode=0o755)
    target = _script(users, "echo 'export X=1'")
    os.chown(target, 65534, 65534)
    link = site_dir / "link"
    link.symlink_to(target)
    assert "not root" in (chain.untrusted(str(link)) or "")
    assert chain.untrusted(str(_script(site_dir, "true", "ok"))) is None


def _main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: Path | None,
          capsys: pytest.CaptureFixture[str], env: dict[str, str] | None = None,
          ) -> tuple[int, list[str]]:
    conf = tmp_path / "colloc.conf"
    conf.write_text(f'mps_root = "{tmp_path / "mps"}"\n'
                    + (f'chain_task_prolog = "{script}"\n' if script else ""))
    monkeypatch.setenv("COLLOC_CONF", str(conf))
    for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
              "XLA_PYTHON_CLIENT_ALLOCATOR", "TF_FORCE_GPU_ALLOW_GROWTH"):
        monkeypatch.delenv(k, raising=False)
    rc = task_prolog_main({"SLURM_JOB_ID": "5", "PATH": "/usr/bin:/bin", **(env or {})})
    return rc, capsys.readouterr().out.splitlines()


def test_main_prints_site_lines_then_collocs_and_returns_the_sites_status(
    site_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    Tenancy(tmp_path / "mps").write_job_env(5, LIMITED)
    p = _script(site_dir, "echo 'export CUDA_MPS_PIPE_DIRECTORY=/site/pipe'\n"
                          "echo 'export TF_FORCE_GPU_ALLOW_GROWTH=false'\nexit 2")
    rc, out = _main(tmp_path, monkeypatch, p, capsys)
    assert rc == 2
    assert out[:2] == ["export CUDA_MPS_PIPE_DIRECTORY=/site/pipe",
                       "export TF_FORCE_GPU_ALLOW_GROWTH=false"]
    # colloc's MPS settings come after the site's: slurmstepd applies them last
    assert "export CUDA_MPS_PIPE_DIRECTORY=/run/x/pipe" in out[2:]
    # the site set TensorFlow's variable: colloc leaves it as the site said
    assert "export TF_FORCE_GPU_ALLOW_GROWTH=true" not in out
    assert "export XLA_PYTHON_CLIENT_PREALLOCATE=false" in out


def test_main_without_a_chain_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    Tenancy(tmp_path / "mps").write_job_env(5, LIMITED)
    rc, out = _main(tmp_path, monkeypatch, None, capsys)
    assert rc == 0 and "export CUDA_MPS_PIPE_DIRECTORY=/run/x/pipe" in out
    assert all(not ln.startswith("print") for ln in out)


def test_main_refused_chain_fails_the_task_but_colloc_still_exports(
    site_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    Tenancy(tmp_path / "mps").write_job_env(5, LIMITED)
    p = _script(site_dir, "true")
    p.chmod(0o757)
    rc, out = _main(tmp_path, monkeypatch, p, capsys)
    assert rc == chain.CANNOT_RUN
    assert "writable by others" in out[0]
    assert "export CUDA_MPS_PIPE_DIRECTORY=/run/x/pipe" in out
