"""The adapter's queries that doctor and the period report use (no public run() needed)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from slurm_colloc.site import doctor
from slurm_colloc.slurm import adapter as ad


class Fake:
    def __init__(self, out: dict[str, str]) -> None:
        self.out = out
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        tool = argv[0].rsplit("/", 1)[-1]
        return subprocess.CompletedProcess(argv, 0, self.out.get(tool, ""), "")


def _cli(monkeypatch: pytest.MonkeyPatch, out: dict[str, str]) -> tuple[ad.SlurmCli, Fake]:
    fake = Fake(out)
    monkeypatch.setattr(subprocess, "run", fake)
    return ad.SlurmCli(env={"PATH": "/usr/bin"}, bindir="/usr/bin"), fake


def test_controller_config_is_what_slurmctld_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    cli, _ = _cli(monkeypatch, {"scontrol": "Configuration data as of x\n"
                                "JobSubmitPlugins        = lua\nCliFilterPlugins = (null)\n"})
    conf = cli.controller_config()
    assert conf["jobsubmitplugins"] == "lua" and conf["clifilterplugins"] == "(null)"


def test_doctor_live_checks_go_through_the_adapter_interface(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cli, _ = _cli(monkeypatch, {
        "scontrol": "JobSubmitPlugins = lua\nCliFilterPlugins = lua\n",
        "sbatch": "      --colloc[=summary]   share a GPU\n",
    })
    monkeypatch.setattr(ad.SlurmCli, "nodes", lambda self: [
        {"NodeName": "n0", "Gres": "gpu:2,shard:78"}])
    found = {f.what: f.level for f in doctor.check_live(cli)}
    assert found["running jobsubmitplugins"] == "ok" and found["sbatch --colloc"] == "ok"
    assert found["nodes with gres/shard"] == "ok"


def test_period_query_keeps_only_the_users_records(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = [{"job_id": i, "name": "t", "user": u, "state": {"current": ["COMPLETED"]}}
            for i, u in ((1, "alice"), (2, "bob"))]
    cli, fake = _cli(monkeypatch, {"sacct": json.dumps({"jobs": jobs})})
    recs = cli.accounting_period("2026-11-01", user="alice")
    assert [r.job_id for r in recs] == ["1"]  # checked here too, whatever sacct answers
    assert "--user=alice" in fake.calls[0] and ad.JSON_FLAG in fake.calls[0]
    assert {r.job_id for r in cli.accounting_period("2026-11-01")} == {"1", "2"}
    assert "--allusers" in fake.calls[1]
