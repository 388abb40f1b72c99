"""``colloc admin doctor --gpus``: compute mode, no-GPU hosts, state directories, DCGM,
container runtimes and the installed programs' version. Everything is faked: no GPU,
no DCGM, no container runtime is needed."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from slurm_colloc import __version__
from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuBackendError, GpuInfo
from slurm_colloc.gpu.nvml import NvmlBackend
from slurm_colloc.site import doctor

GPUS = [GpuInfo(0, "GPU-aaa", "A100", 40960, minor_number=0, reserved_mib=512),
        GpuInfo(1, "GPU-bbb", "A100", 40960, minor_number=1, reserved_mib=512)]


class FakeNvml(NvmlBackend):
    """An NVML backend (isinstance holds) that answers from fixed values."""

    def __init__(self, modes: dict[int, str], error: Exception | None = None) -> None:
        self.modes, self.error = modes, error

    def gpus(self) -> list[GpuInfo]:
        if self.error is not None:
            raise self.error
        return GPUS

    def compute_modes(self) -> dict[int, str]:
        return self.modes

    def close(self) -> None:
        pass


def _gpus(monkeypatch: pytest.MonkeyPatch, backend: object, **cfg: object) -> dict[
        str, doctor.Finding]:
    monkeypatch.setattr("slurm_colloc.gpu.select.backend_from_config",
                        lambda cfg, **kw: backend)
    config = CollocConfig(**cfg)  # type: ignore[arg-type]
    return {f.what: f for f in doctor.check_gpus(config)}


# --- compute mode ----------------------------------------------------------------------


def test_exclusive_process_fails_with_the_command_that_fixes_it(monkeypatch) -> None:
    found = _gpus(monkeypatch, FakeNvml({0: "DEFAULT", 1: "EXCLUSIVE_PROCESS"}))
    mode = found["GPU compute mode"]
    assert mode.level == "fail"
    assert "nvidia-smi -i 1 -c DEFAULT" in mode.detail and "EXCLUSIVE_PROCESS" in mode.detail


def test_default_mode_is_ok_and_names_what_catches_processes_outside_mps(monkeypatch) -> None:
    mode = _gpus(monkeypatch, FakeNvml({0: "DEFAULT", 1: "DEFAULT"}))["GPU compute mode"]
    assert mode.level == "ok" and 'enforce_outside_mps = "flag"' in mode.detail


def test_default_mode_without_enforcement_warns(monkeypatch) -> None:
    mode = _gpus(monkeypatch, FakeNvml({0: "DEFAULT", 1: "DEFAULT"}),
                 enforce_outside_mps="off")["GPU compute mode"]
    assert mode.level == "warn" and 'enforce_outside_mps = "flag"' in mode.detail


# --- hosts without GPUs ---------------------------------------------------------------


def _no_nvml(cfg: CollocConfig, **kw: object) -> object:
    raise GpuBackendError("NVML initialisation failed (NVML Shared Library Not Found)")


def test_no_gpu_backend_on_a_host_without_gpus_is_one_skip_line(monkeypatch) -> None:
    monkeypatch.setattr("slurm_colloc.gpu.select.backend_from_config", _no_nvml)
    monkeypatch.setattr(doctor, "gpu_host", lambda cfg, dev=None: False)
    found = doctor.check_gpus(CollocConfig())
    assert [f.what for f in found] == ["no GPU backend"]
    assert found[0].level == "warn" and "GPU checks skipped" in found[0].detail
    assert "Shared Library Not Found" in found[0].detail


def test_no_gpu_backend_on_a_gpu_node_fails(monkeypatch) -> None:
    monkeypatch.setattr("slurm_colloc.gpu.select.backend_from_config", _no_nvml)
    monkeypatch.setattr(doctor, "gpu_host", lambda cfg, dev=None: True)
    (found,) = doctor.check_gpus(CollocConfig())
    assert found.level == "fail" and found.what == "gpu backend nvml"


def test_an_unexpected_error_is_a_line_not_a_traceback(monkeypatch) -> None:
    found = _gpus(monkeypatch, FakeNvml({}, error=KeyError("boom")))
    assert found["gpu backend nvml"].level == "fail"
    assert "KeyError" in found["gpu backend nvml"].detail


def test_gpu_host_is_told_by_device_files(tmp_path: Path) -> None:
    assert not doctor.gpu_host(CollocConfig(), tmp_path)
    (tmp_path / "nvidiactl").touch()  # the control device alone is not a GPU
    assert not doctor.gpu_host(CollocConfig(), tmp_path)
    (tmp_path / "nvidia3").touch()
    assert doctor.gpu_host(CollocConfig(), tmp_path)
    assert doctor.gpu_host(CollocConfig(gpu_backend="sim"), tmp_path / "none")


def test_node_checks_on_a_host_without_gpus_are_skipped(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(doctor, "check_scripts", lambda conf: [])
    found = doctor.check_node(CollocConfig(), None, dev=tmp_path)
    assert [(f.level, f.what) for f in found] == [("warn", "node checks")]
    assert "controller or login host" in found[0].detail


# --- state directories ----------------------------------------------------------------


def _dirs(tmp_path: Path, owner: int | None = None) -> dict[str, doctor.Finding]:
    cfg = CollocConfig(metrics_dir=str(tmp_path / "metrics"),
                       evidence_dir=str(tmp_path / "evidence"),
                       history_db=str(tmp_path / "hist" / "history.sqlite"))
    uid = os.getuid() if owner is None else owner
    return {f.what: f for f in doctor.check_dirs(cfg, owner_uid=uid)}


def test_state_directories_missing_are_made_later(tmp_path: Path) -> None:
    found = _dirs(tmp_path)
    assert {f.level for f in found.values()} == {"ok"}
    assert set(found) == {"metrics_dir", "evidence_dir", "history_db directory"}
    assert "created by the first job" in found["metrics_dir"].detail


def test_state_directories_root_only(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir(mode=0o755)
    (tmp_path / "evidence").mkdir()
    (tmp_path / "evidence").chmod(0o775)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "hist").symlink_to(tmp_path / "elsewhere")
    found = _dirs(tmp_path)
    assert found["metrics_dir"].level == "ok"
    assert found["evidence_dir"].level == "fail"
    assert f"chmod go-w {tmp_path / 'evidence'}" in found["evidence_dir"].detail
    assert found["history_db directory"].level == "fail"
    assert "symlink" in found["history_db directory"].detail


def test_state_directory_of_another_owner_fails(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir(mode=0o755)
    found = _dirs(tmp_path, owner=os.getuid() + 1)
    assert found["metrics_dir"].level == "fail" and "chown root:root" in found[
        "metrics_dir"].detail


# --- DCGM -----------------------------------------------------------------------------


def _proc(tmp_path: Path, *names: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "self").mkdir()
    for pid, name in enumerate(names, start=100):
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "comm").write_text(name + "\n")
    return proc


def _dcgm(tmp_path: Path, *, running: bool, bindings: str | None, dcgmi: bool,
          discovery: tuple[int, str] = (0, "2 GPUs found."),
          backend: str = "nvml") -> tuple[doctor.Finding, list[list[str]]]:
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> tuple[int, str]:
        calls.append(list(argv))
        return discovery

    proc = _proc(tmp_path, "slurmd", *(["nv-hostengine"] if running else []))
    (found,) = doctor.check_dcgm(
        CollocConfig(gpu_backend=backend),  # type: ignore[arg-type]
        which=lambda n: "/usr/bin/dcgmi" if dcgmi and n == "dcgmi" else None,
        proc=proc, bindings=lambda: bindings, run=run)
    return found, calls


def test_dcgm_absent_is_fine_and_says_nvml_is_used(tmp_path: Path) -> None:
    found, calls = _dcgm(tmp_path, running=False, bindings=None, dcgmi=False)
    assert found.level == "ok" and found.what == "DCGM (optional)"
    assert "DCGM profiling metrics" in found.detail and "NVML utilization used" in found.detail
    assert calls == []


def test_dcgm_installed_but_host_engine_down_warns(tmp_path: Path) -> None:
    found, _ = _dcgm(tmp_path, running=False, bindings="/usr/local/dcgm", dcgmi=True)
    assert found.level == "warn" and "systemctl enable --now nvidia-dcgm" in found.detail


def test_dcgm_running_and_reachable(tmp_path: Path) -> None:
    found, calls = _dcgm(tmp_path, running=True, bindings="/usr/local/dcgm", dcgmi=True)
    assert found.level == "ok" and "pid 101" in found.detail
    assert calls == [["/usr/bin/dcgmi", "discovery", "-l"]]


def test_dcgm_host_engine_unreachable_warns(tmp_path: Path) -> None:
    found, _ = _dcgm(tmp_path, running=True, bindings="/usr/local/dcgm", dcgmi=True,
                     discovery=(255, "Error: unable to establish a connection"))
    assert found.level == "warn" and "unable to establish a connection" in found.detail


def test_dcgm_without_bindings_warns(tmp_path: Path) -> None:
    found, _ = _dcgm(tmp_path, running=True, bindings=None, dcgmi=False)
    assert found.level == "warn" and "DcgmReader" in found.detail


def test_dcgm_is_not_asked_about_on_the_simulation(tmp_path: Path) -> None:
    found, _ = _dcgm(tmp_path, running=True, bindings=None, dcgmi=True, backend="sim")
    assert found.level == "ok" and "sim" in found.detail


# --- containers -----------------------------------------------------------------------


def _containers(tmp_path: Path, tools: set[str], plugstack: str = "",
                mps_root: str = "/run/colloc/mps") -> dict[str, doctor.Finding]:
    etc = tmp_path / "etc"
    etc.mkdir(exist_ok=True)
    slurm_conf = tmp_path / "slurm.conf"
    (tmp_path / "plugstack.conf").write_text(plugstack)
    slurm_conf.write_text(f"PlugStackConfig={tmp_path / 'plugstack.conf'}\n")
    found = doctor.check_containers(CollocConfig(mps_root=mps_root), slurm_conf,
                                    which=lambda n: f"/usr/bin/{n}" if n in tools else None,
                                    etc=etc)
    return {f.what: f for f in found}


def test_no_container_runtime_nothing_to_bind(tmp_path: Path) -> None:
    found = _containers(tmp_path, set())
    assert [(f.level, w) for w, f in found.items()] == [("ok", "containers")]


def test_enroot_without_a_mount_warns_with_the_exact_lines(tmp_path: Path) -> None:
    found = _containers(tmp_path, {"enroot"})
    f = found["containers: enroot"]
    assert f.level == "warn"
    assert "/run/colloc/mps /run/colloc/mps none x-create=dir,bind,ro,nosuid,nodev" in f.detail
    assert "mounts.d/90-colloc.fstab" in f.detail
    assert "--container-mounts=/run/colloc/mps:/run/colloc/mps:ro" in f.detail


def test_pyxis_is_found_through_plugstack(tmp_path: Path) -> None:
    found = _containers(tmp_path, set(), plugstack="required /usr/lib/slurm/spank_pyxis.so\n")
    assert found["containers: pyxis"].level == "warn"


def test_enroot_mount_of_a_parent_directory_counts(tmp_path: Path) -> None:
    mounts = tmp_path / "etc" / "enroot" / "mounts.d"
    mounts.mkdir(parents=True)
    (mounts / "10-run.fstab").write_text("# site mounts\n/run/colloc /run/colloc none "
                                         "x-create=dir,bind\n")
    found = _containers(tmp_path, set())  # /etc/enroot alone says enroot is here
    assert found["containers: enroot"].level == "ok"
    (mounts / "10-run.fstab").write_text("/run/colloc-other /run/x none bind\n")
    assert _containers(tmp_path, set())["containers: enroot"].level == "warn"


def test_apptainer_bind_path(tmp_path: Path) -> None:
    f = _containers(tmp_path, {"apptainer"})["containers: apptainer"]
    assert f.level == "warn" and "bind path = /run/colloc/mps" in f.detail
    assert "--bind /run/colloc/mps:/run/colloc/mps:ro" in f.detail
    conf = tmp_path / "etc" / "apptainer" / "apptainer.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("bind path = /etc/localtime\nbind path = /run/colloc/mps\n")
    assert _containers(tmp_path, {"apptainer"})["containers: apptainer"].level == "ok"


# --- installed programs ----------------------------------------------------------------


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_a_script_of_this_interpreter_is_this_version(tmp_path: Path) -> None:
    s = _script(tmp_path / "colloc", f"#!{sys.executable}\nimport sys\n")
    assert doctor.script_version(s, run=lambda a: (1, "")) == (
        __version__, f"{s} (this installation)")


def test_a_script_of_another_installation_is_asked(tmp_path: Path) -> None:
    s = _script(tmp_path / "colloc", "#!/opt/old/bin/python\n")
    asked: list[list[str]] = []

    def run(argv: Sequence[str]) -> tuple[int, str]:
        asked.append(list(argv))
        return 0, "0.0.9\n"

    assert doctor.script_version(s, run=run)[0] == "0.0.9"
    assert asked[0][:2] == ["/opt/old/bin/python", "-c"]


def test_a_wrapper_is_followed_once(tmp_path: Path) -> None:
    real = _script(tmp_path / "colloc-prolog", f"#!{sys.executable}\n")
    w = _script(tmp_path / "wrap", f'#!/bin/sh\nexport COLLOC_CONF=/x\nexec {real} "$@"\n')
    assert doctor.script_version(w)[0] == __version__
    niced = _script(tmp_path / "niced", f'#!/bin/sh\nexec /usr/bin/nice -n -5 {real} "$@"\n')
    assert doctor.script_version(niced)[0] == __version__  # the devcluster's (issue 28)
    loop = _script(tmp_path / "loop", f"#!/bin/sh\nexec {w}\n")
    assert doctor.script_version(loop)[0] is None


def test_scripts_versions_on_path_and_in_slurm_conf(tmp_path: Path) -> None:
    old = _script(tmp_path / "colloc-epilog", "#!/opt/old/bin/python\n")
    new = _script(tmp_path / "colloc-prolog", f"#!{sys.executable}\n")
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"Prolog={new}\nEpilog={old}\nTaskProlog=/nowhere/colloc-task-prolog\n")
    found = {f.what: f for f in doctor.check_scripts(
        conf, which=lambda n: str(new) if n == "colloc" else None,
        run=lambda a: (0, "0.0.9"))}
    assert found["colloc on PATH"].level == "ok"
    assert found["colloc-report on PATH"].level == "warn"
    assert "/usr/local/bin" in found["colloc-report on PATH"].detail
    assert found["slurm.conf prolog version"].level == "ok"
    assert found["slurm.conf epilog version"].level == "fail"
    assert "0.0.9" in found["slurm.conf epilog version"].detail
    assert "slurm.conf taskprolog version" not in found  # missing: check_node says so
