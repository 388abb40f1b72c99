"""Rendering of the devcluster's Slurm configuration (no daemons needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_colloc.devcluster import configs
from slurm_colloc.devcluster.layout import Layout, Spec


def test_gres_conf_binds_shards_per_gpu() -> None:
    spec = Spec(gpus=3, gpu_memory_mib=40960, shard_mib=1024)
    text = configs.gres_conf(spec, Layout(Path("/r")))
    shard_lines = [ln for ln in text.splitlines() if ln.startswith("Name=shard")]
    # (40960 - 512 reserved - 2 x 64 MPS servers) // 1024 = 39: 40 would over-commit
    assert shard_lines == [f"Name=shard Count=39 File=/r/dev/nvidia{i}" for i in range(3)]


def test_slurm_conf_declares_node_gres_and_accounting() -> None:
    spec = Spec(gpus=2, gpu_memory_mib=20480 + 512 + 128, shard_mib=1024)
    text = configs.slurm_conf(spec, Layout(Path("/r")), {"Prolog": Path("/r/bin/p")})
    assert "Gres=gpu:2,shard:40 " in text  # 20 whole shards per GPU: never over-promise
    smaller = Spec(gpus=2, gpu_memory_mib=20480 + 512 + 127, shard_mib=1024)
    assert "Gres=gpu:2,shard:38 " in configs.slurm_conf(smaller, Layout(Path("/r")))
    assert "SelectType=select/cons_tres" in text
    assert "AccountingStoragePass=/r/munge/munge.socket" in text
    assert "Prolog=/r/bin/p" in text and "PrologFlags=Alloc" in text


@pytest.mark.parametrize(
    "spec",
    [Spec(gpus=0), Spec(gpu_memory_mib=10), Spec(ctld_port=16818), Spec(mysql_port=80)],
)
def test_bad_shapes_are_refused(spec: Spec) -> None:
    with pytest.raises(ValueError):
        spec.validate()


def test_spec_round_trips() -> None:
    s = Spec(gpus=8, gpu_memory_mib=81920)
    assert Spec.from_json(s.to_json()) == s


def test_only_daemons_that_are_down_are_started_in_dependency_order() -> None:
    from slurm_colloc.devcluster.cluster import to_start

    every = {"munged": 1, "mariadb": 2, "slurmdbd": 3, "slurmctld": 4, "slurmd": 5}
    assert to_start(every) == []
    assert to_start({**every, "slurmctld": None}) == ["slurmctld"]
    assert to_start({**every, "slurmd": None, "munged": None}) == ["munged", "slurmd"]
    assert to_start(dict.fromkeys(reversed(list(every)))) == list(every)


def test_up_resumes_the_same_shape_and_rebuilds_only_when_asked() -> None:
    from slurm_colloc.devcluster.cluster import up_plan
    from slurm_colloc.devcluster.daemons import DaemonError

    s = Spec(ctld_port=46837)
    assert up_plan(None, s, fresh=False) == "build"
    assert up_plan(Spec.from_json(s.to_json()), s, fresh=False) == "resume"
    assert up_plan(s, s, fresh=True) == "build"
    assert up_plan(Spec(gpus=2), s, fresh=True) == "build"
    with pytest.raises(DaemonError, match="--fresh"):
        up_plan(Spec(gpus=2), s, fresh=False)  # never wipe a cluster unasked
