"""A job is never handed MPS under a server cap smaller than its user's share (issue 24).

philly90h-007 (9,728 MiB allowed) died of OOM at 8.8 GiB inside its reservation: it
joined its user's running server, whose cap still held only the co-tenant's 7,680 MiB.
The prolog now retries raising the cap once and otherwise takes MPS back from the job.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from slurm_colloc.mps.control import MpsControlError
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import prolog


class Daemon:
    """cap_user fails ``fails`` times, then takes the cap."""

    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.caps: list[int] = []

    def cap_user(self, total: int) -> None:
        if self.fails:
            self.fails -= 1
            raise MpsControlError("daemon did not take set_default_device_pinned_mem_limit")
        self.caps.append(total)


def _setup(tmp_path: Path) -> tuple[Tenancy, Any]:
    tenancy = Tenancy(tmp_path / "mps")
    tenancy.add_job(0, 0, 7)
    tenancy.write_job_env(7, {"CUDA_MPS_PIPE_DIRECTORY": "/x", "COLLOC_PINNED_MIB": "9216"})
    return tenancy, SimpleNamespace(job_id=7, uid=0)


def test_a_cap_the_daemon_refuses_takes_mps_back_from_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prolog.time, "sleep", lambda s: None)
    tenancy, ctx = _setup(tmp_path)
    daemon = Daemon(fails=5)
    with pytest.raises(MpsControlError):
        prolog._cap_or_withdraw(ctx, tenancy, daemon, 16896)  # type: ignore[arg-type]
    assert not tenancy.job_env_file(7).exists()  # the TaskProlog exports no MPS
    assert 7 not in tenancy.jobs_of(0, 0)
    assert daemon.fails == 5 - prolog.CAP_TRIES


def test_a_busy_daemon_gets_a_second_try(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prolog.time, "sleep", lambda s: None)
    tenancy, ctx = _setup(tmp_path)
    daemon = Daemon(fails=1)
    prolog._cap_or_withdraw(ctx, tenancy, daemon, 16896)  # type: ignore[arg-type]
    assert daemon.caps == [16896]
    assert tenancy.job_env_file(7).exists() and 7 in tenancy.jobs_of(0, 0)
