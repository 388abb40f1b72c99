"""Issue 23, item 2, replayed live: a tree planted in the user's MPS pipe directory.

``colloc-u1`` (attacker) plants a deep tree (the live attack: 1,200 levels made the
next prolog for that user and GPU die in ``shutil.rmtree`` under the GPU lock, so
every later job of that user there ran with no MPS and no limit), a wide tree, a
link to elsewhere, a FIFO and some data in its pipe directory during a shard job.
After the job nothing it planted exists, and the next shard jobs of the attacker and
of ``colloc-u2`` (victim) on that GPU get MPS and their limit.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import node_state, sbatch
from tests.e2e.test_adversarial import ATTACKER, VICTIM, _log, _prolog_line, users  # noqa: F401
from tests.e2e.test_node_path import _one_gpu_with_room

SHOW = 'echo "LIMIT=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT PIPE=$CUDA_MPS_PIPE_DIRECTORY GPU=$COLLOC_GPU"'
PLANT = r'''
PY="$(dirname "$(command -v colloc)")/python"
"$PY" - "$CUDA_MPS_PIPE_DIRECTORY" "$PWD/keep-me" <<'EOF'
import os, sys
pipe, outside = sys.argv[1], sys.argv[2]
top = os.open(pipe, os.O_RDONLY | os.O_DIRECTORY)
os.mkdir("deep", dir_fd=top)
fd = os.open("deep", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
for _ in range(3000):
    os.mkdir("d", dir_fd=fd)
    nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = nfd
os.close(fd)
os.mkdir("wide", dir_fd=top)
fd = os.open("wide", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
for i in range(30000):
    os.close(os.open(f"f{i}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
os.close(fd)
os.symlink(outside, "to-outside", dir_fd=top)
os.mkfifo("fifo", dir_fd=top)
with open(os.open("data", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=top), "wb") as f:
    f.write(b"x" * (4 << 20))
print("planted", len(os.listdir(pipe)))
EOF
'''


def _field(out: str, key: str) -> str:
    m = re.search(rf"{key}=(\S*)", out)
    assert m, out
    return m.group(1)


def _quarantined(tenancy: Tenancy) -> list[str]:
    q = tenancy.quarantine_dir
    return sorted(os.listdir(q)) if q.is_dir() else []


def test_a_tree_planted_in_the_pipe_dir_does_not_survive_or_switch_off_mps(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None  # noqa: F811
) -> None:
    tenancy = Tenancy(Path(cfgmod.load(cluster.layout.colloc_conf).mps_root))
    keep = workdir / "keep-me"
    keep.write_text("the attacker's own file")
    with _one_gpu_with_room(cluster, slurm, workdir):  # every job below on one GPU
        attack = sbatch(cluster, workdir, f"{SHOW}\ncolloc-simjob --mem 1G --seconds 1\n{PLANT}",
                        "--gres=shard:2", user=ATTACKER)
        assert wait_for_jobs(slurm, [attack], timeout=120)[str(attack)] == "COMPLETED"
        out = (workdir / f"{attack}.out").read_text()
        assert "planted 7" in out, out  # with the control socket and the pid file
        pipe, gpu = Path(_field(out, "PIPE")), _field(out, "GPU")
        assert str(pipe).startswith(str(tenancy.root)) and gpu.isdigit(), out

        # after the job: nothing it planted exists, in the pipe dir or in root's quarantine
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (os.path.lexists(pipe) or _quarantined(tenancy)):
            time.sleep(1)
        assert not os.path.lexists(pipe), sorted(os.listdir(pipe))[:10]
        assert _quarantined(tenancy) == []
        assert keep.read_text() == "the attacker's own file"  # the link was not followed

        # the next shard jobs of both users on that GPU get MPS and their limit
        nxt = {u: sbatch(cluster, workdir, f"{SHOW}\ncolloc-simjob --mem 1G --seconds 1",
                         "--gres=shard:2", user=u) for u in (ATTACKER, VICTIM)}
        states = wait_for_jobs(slurm, list(nxt.values()), timeout=120)
    for user, job in nxt.items():
        assert states[str(job)] == "COMPLETED", (user, states)
        out = (workdir / f"{job}.out").read_text()
        assert _field(out, "GPU") == gpu, (user, out)  # the attacked GPU
        assert "LIMIT=0=1536M" in out and _field(out, "PIPE"), (user, out)
        line = _prolog_line(cluster, job)
        assert "shared gpu=" in line and "limit_mib=2048" in line, (user, line)
        assert f"job {job}: internal error" not in _log(cluster)
    assert node_state(cluster) in ("idle", "mix")
