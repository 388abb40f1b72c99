"""Issue 24 item 5: an OOM inside a reservation says what bound it.

philly90h x120 run 3, colloc-oracle: philly90h-007 (10 shards, pinned 9,728 MiB, footprint
8,119 -> 9,343 MiB) died at its peak with 10-20 GiB free on its GPU (the committed GPU
series), beside philly90h-005 of the same user (8 shards, pinned 7,680 MiB). Only a limit
below 8,831 MiB refuses that peak: its server's, capped at the user's total *without*
007. These tests replay that pair in the sim: with the server capped at 005's limit the
job dies as in the replay and now says which limit bound it; with the cap the prolog
means to set (both jobs' limits) it completes.
"""

from __future__ import annotations

import subprocess

from tests.unit.test_sim_simjob import CTL, mps, run, state  # noqa: F401 - fixtures

OWN = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
JOB_007 = ("--mem", "8119M", "--peak", "9343M", "--peak-at", "0.1", "--seconds", "0.5")


def cap_server(env: dict[str, str], mib: int) -> None:
    """The prolog's cap_user: the user's servers' default pinned limit."""
    out = subprocess.run(CTL, input=f"set_default_device_pinned_mem_limit 0 {mib}M\n",
                         text=True, env=env, capture_output=True, timeout=20)
    assert out.returncode == 0 and not out.stdout.strip(), out


def test_a_server_cap_below_the_jobs_own_limit_binds_and_says_so(state, mps):  # noqa: F811
    cap_server(mps, 7680)  # 005's pinned limit only
    r = run({**mps, OWN: "0=9728M"}, *JOB_007)
    assert r.returncode == 1
    assert "torch.OutOfMemoryError" in r.stderr
    assert ("pinned limit (7680 MiB) is below this job's own "
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (9728 MiB): the server's binds") in r.stderr
    assert ("refused by the MPS limit (7680 MiB, the server's; this job's own is 9728 MiB)"
            in r.stderr)


def test_with_the_users_total_as_the_cap_the_same_job_completes(state, mps):  # noqa: F811
    cap_server(mps, 7680 + 9728)  # both jobs' pinned limits: what the prolog computes
    r = run({**mps, OWN: "0=9728M"}, *JOB_007)
    assert r.returncode == 0, r.stderr
    assert "the server's binds" not in r.stderr


def test_a_full_gpu_is_named_as_the_bound(state, mps):  # noqa: F811
    r = run({**mps, "CUDA_VISIBLE_DEVICES": "1"}, "--mem", "41000M", "--seconds", "0.2")
    assert r.returncode == 1
    assert "refused by the GPU's free memory: GPU 1 free" in r.stderr
