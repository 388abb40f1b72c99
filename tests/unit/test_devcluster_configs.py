"""Rendering of the devcluster's Slurm configuration (no daemons needed)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
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
    [Spec(gpus=0), Spec(gpu_memory_mib=10), Spec(ctld_port=16818), Spec(mysql_port=80),
     Spec(mps_protocol="auto")],
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


def test_multi_node_hosts_have_two_gpu_sizes_and_shards_only_in_the_shared_partition() -> None:
    spec = Spec(nodes=3, gpus=2, gpu_memory_mib=40960, ctld_port=25817)
    plans = spec.node_plans()
    assert [(p.name, p.gpus, p.gpu_memory_mib, p.partition) for p in plans] == [
        ("colloc-node0", 2, 40960, "shared"),
        ("colloc-node1", 1, 81920, "shared80"),
        ("colloc-node2", 2, 40960, "gpu"),
    ]
    # each host's shards come from its own GPU size; the whole-GPU host has none
    assert [p.shards_per_gpu for p in plans] == [39, 79, 0]
    assert len({p.addr for p in plans} | {spec.controller_addr()}) == 4
    gres = configs.gres_conf(spec, Layout(Path("/r")))
    assert "NodeName=colloc-node1 Name=shard Count=79 File=/r/dev/colloc-node1/nvidia0" in gres
    assert not [ln for ln in gres.splitlines() if "colloc-node2" in ln and "shard" in ln]
    conf = configs.slurm_conf(spec, Layout(Path("/r")))
    assert "SlurmctldHost=" in conf and f"({spec.controller_addr()})" in conf
    assert f"AccountingStorageHost={spec.controller_addr()}" in conf
    assert "Gres=gpu:2 Weight=3 Feature=gpu40g" in conf  # no shards on the whole-GPU host
    # one shared partition per GPU size: a one-GPU job there is all shards of a GPU
    assert "PartitionName=shared Nodes=colloc-node0 MaxTime" in conf
    assert "PartitionName=shared80 Nodes=colloc-node1 MaxTime" in conf
    assert "PartitionName=gpu Nodes=colloc-node2 Default=YES" in conf
    colloc = configs.colloc_conf(spec, Layout(Path("/r")))
    assert 'shared_partitions = ["shared:40960", "shared80:81920"]' in colloc


@pytest.mark.parametrize(("protocol", "stand_in"),
                         [("2", "colloc-sim-mps-control"), ("3", "colloc-sim-mps-control-v3")])
def test_the_mps_protocol_picks_its_stand_in(protocol: str, stand_in: str) -> None:
    """issue 25 item 3: a replay policy runs legacy MPS or v3 by its cluster's spec."""
    conf = configs.colloc_conf(Spec(mps_protocol=protocol), Layout(Path("/r")))
    cfg = cfgmod.from_mapping(tomllib.loads(conf))
    # the lab's own launcher, not a console script of the wheel (issue 26 item 7)
    assert cfg.mps_protocol == protocol and cfg.mps_control == f"/r/lab-bin/{stand_in}"


def test_a_packing_cluster_leaves_out_least_loaded_placement() -> None:
    """issue 25 item 1: the replay's colloc-pack measures first fit against spreading."""
    layout = Layout(Path("/r"))
    spread = configs.slurm_conf(Spec(), layout, version=(24, 11))
    packed = configs.slurm_conf(Spec(spread_shards=False), layout, version=(24, 11))
    assert "SelectTypeParameters=CR_Core_Memory,LL_SHARED_GRES\n" in spread
    assert "SelectTypeParameters=CR_Core_Memory\n" in packed and "LL_SHARED" not in packed


def test_size_priority_and_compute_admission_reach_the_cluster_configs() -> None:
    """issue 25: replay policies that weigh priority by GPU share or admit by compute."""
    layout = Layout(Path("/r"))
    plain = configs.slurm_conf(Spec(), layout, version=(26, 5))
    assert "PriorityType" not in plain and "PriorityWeightTRES" not in plain
    spec = Spec(priority_weight_tres="GRES/shard=10000,GRES/gpu=10000", sm_capacity_pct=108)
    spec.validate()
    conf = configs.slurm_conf(spec, layout, version=(26, 5))
    assert "PriorityType=priority/multifactor\n" in conf
    assert "PriorityWeightTRES=GRES/shard=10000,GRES/gpu=10000\n" in conf
    cfg = cfgmod.from_mapping(tomllib.loads(configs.colloc_conf(spec, layout)))
    assert cfg.sm_capacity_pct == 108
    assert cfg.compute_history_file == str(layout.colloc_var / "compute-history")
    for bad in ("GRES/shard", "GRES/shard=1\nX=1", "a=1,,b=2"):
        with pytest.raises(ValueError, match="priority_weight_tres"):
            Spec(priority_weight_tres=bad).validate()


def test_one_node_lab_keeps_its_single_partition_shared() -> None:
    spec = Spec()
    assert [p.partition for p in spec.node_plans()] == ["gpu"]
    assert 'shared_partitions = ["gpu"]' in configs.colloc_conf(spec, Layout(Path("/r")))
    assert "PartitionName=gpu Nodes=colloc-node0 Default=YES" in configs.slurm_conf(
        spec, Layout(Path("/r")))


def test_uniform_hosts_are_alike_and_share_one_partition_with_shards() -> None:
    """A replay's cluster: only the number of hosts differs from the one-node lab."""
    one = Spec(gpus=2, ctld_port=25817)
    spec = Spec(nodes=2, gpus=2, uniform=True, ctld_port=25817)
    plans = spec.node_plans()
    assert [(p.name, p.gpus, p.gpu_memory_mib, p.partition, p.shards_per_gpu) for p in plans] \
        == [("colloc-node0", 2, 40960, "gpu", one.shards_per_gpu),
            ("colloc-node1", 2, 40960, "gpu", one.shards_per_gpu)]
    assert len({p.addr for p in plans}) == 2 and spec.multi_node
    conf = configs.slurm_conf(spec, Layout(Path("/r")))
    assert "PartitionName=gpu Nodes=colloc-node0,colloc-node1 Default=YES" in conf
    assert conf.count(f"Gres=gpu:2,shard:{2 * one.shards_per_gpu}") == 2
    gres = configs.gres_conf(spec, Layout(Path("/r")))
    assert f"NodeName=colloc-node1 Name=shard Count={one.shards_per_gpu} " \
        "File=/r/dev/colloc-node1/nvidia1" in gres
    assert 'shared_partitions = ["gpu"]' in configs.colloc_conf(spec, Layout(Path("/r")))
    assert Spec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="--uniform needs --nodes"):
        Spec(uniform=True).validate()
    Spec(nodes=2, uniform=True, gpu_memory_mib=600 * 1024).validate()  # no doubled hosts


def test_compute_hosts_get_private_state_but_share_home() -> None:
    from slurm_colloc.devcluster import hosts

    spec = Spec(nodes=2, ctld_port=25817)
    layout = Layout(Path("/r"))
    node = spec.node_plans()[1]
    targets = {str(t) for _, t in layout.node_private(node.name)}
    assert targets == {"/r/colloc", "/r/sim", "/r/run/mps", "/tmp"}
    argv = hosts.slurmd_argv(spec, layout, node)
    assert argv[:2] == ("nsenter", f"--net=/run/netns/{hosts.netns_name(spec, node)}")
    assert argv[-3:] == ("/usr/sbin/slurmd", "-N", node.name)
    assert "/home" not in " ".join(argv)
    # names fit Linux's 15-character interface names for any port
    assert len(hosts.bridge_name(Spec(nodes=2, ctld_port=65000))) <= 15


def test_restart_names_expand_to_every_slurmd() -> None:
    from slurm_colloc.devcluster.cluster import expand, to_start

    names = ["munged", "slurmctld", "slurmd-a", "slurmd-b"]
    assert expand("slurmd", names) == ["slurmd-a", "slurmd-b"]
    assert expand("slurmd-b", names) == ["slurmd-b"]
    assert expand("nope", names) == []
    assert to_start({"slurmd-b": None, "munged": None, "slurmctld": 1}) == ["munged", "slurmd-b"]


def test_a_checkout_under_tmp_stays_visible_on_every_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI clones into /tmp: the hosts' private /tmp must not hide the venv's scripts."""
    import sys

    from slurm_colloc.devcluster import hosts

    spec = Spec(nodes=2, ctld_port=25817)
    layout = Layout(Path("/r"))
    node = spec.node_plans()[0]
    monkeypatch.setattr(hosts, "colloc_paths",
                        lambda: [Path("/tmp/ci/main/.venv"), Path("/tmp/ci/main")])
    argv = list(hosts.slurmd_argv(spec, layout, node))
    pre = argv.index("/tmp/ci")
    assert argv[pre + 1] == f"/r/nodes/{node.name}/tmp/ci"
    assert pre < argv.index(f"/r/nodes/{node.name}/tmp")  # before /tmp is replaced
    monkeypatch.setattr(hosts, "colloc_paths", lambda: [Path("/opt/venv"), Path("/srv/colloc")])
    assert "/tmp/ci" not in hosts.slurmd_argv(spec, layout, node)
    assert sys.prefix  # the real paths are what a cluster started from this process uses
