"""``colloc selftest --gpu``: the hardware acceptance kit (docs/selftest.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import click


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _sizes(value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in _csv(value))
    except ValueError:
        raise click.BadParameter(f"{value!r}: comma-separated integers expected") from None
    if not sizes or any(n < 64 or n > 32768 for n in sizes):
        raise click.BadParameter("matrix sizes must be between 64 and 32768")
    return sizes


@click.command()
@click.option("--gpu", "gpu", is_flag=True,
              help="Run the GPU acceptance kit (root, a GPU node, PyTorch installed).")
@click.option("--gpu-index", type=click.IntRange(min=0), default=None,
              help="Slurm's index of the GPU to test (default: the node's last GPU).")
@click.option("--users", default="", metavar="A,B",
              help="Two existing users to run the clients as (two-user checks).")
@click.option("--create-users", is_flag=True,
              help="Create colloc-kit1/colloc-kit2 if missing; removed afterwards.")
@click.option("--python", "python", default=sys.executable, show_default=True,
              help="Interpreter with torch that the clients run (readable by the users).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Results file (default ./colloc-selftest-<host>-<date>.json).")
@click.option("--conf", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="colloc.conf to take shard_mib and overheads from (default: the site's).")
@click.option("--shard-mib", type=click.IntRange(min=64), default=None,
              help="Shard size for the test jobs (default: colloc.conf's).")
@click.option("--bench-seconds", type=click.FloatRange(min=0.5, max=600), default=8.0,
              show_default=True, help="Length of each throughput measurement.")
@click.option("--bench-sizes", default="2048,8192", show_default=True,
              help="Matmul sizes (N for N x N fp16) of the throughput measurement.")
@click.option("--tolerance-mib", type=click.IntRange(min=0), default=16, show_default=True,
              help="NVML vs nvidia-smi slack (or 2%, whichever is larger).")
def selftest(gpu: bool, gpu_index: int | None, users: str, create_users: bool, python: str,
             json_path: Path | None, conf: Path | None, shard_mib: int | None,
             bench_seconds: float, bench_sizes: str, tolerance_mib: int) -> None:
    """Check colloc on this node's real GPU, driver, MPS and PyTorch.

    Runs colloc's own prolog, TaskProlog and epilog for made-up jobs on one GPU,
    with PyTorch clients as the jobs' users. Exit status: 0 all checks that ran
    passed, 1 a check failed, 2 this machine cannot run the kit (one line says why).
    """
    from rich.console import Console

    from slurm_colloc import config as cfgmod
    from slurm_colloc.selftest import gpu_kit, report

    if not gpu:
        raise click.UsageError("only the GPU kit exists: colloc selftest --gpu")
    try:
        site = cfgmod.load(conf)
    except cfgmod.ConfigError as e:
        _refuse(gpu_kit.one_line(str(e)))
    opts = gpu_kit.KitOptions(
        gpu_index=gpu_index, users=_csv(users), create_users=create_users, python=python,
        shard_mib=shard_mib, bench_seconds=bench_seconds, bench_sizes=_sizes(bench_sizes),
        tolerance_mib=tolerance_mib,
    )
    from slurm_colloc.selftest.system import real_deps

    res = gpu_kit.run_kit(opts, real_deps(), site)
    if res.refusal is not None:
        _refuse(res.refusal)
    path = json_path or report.default_json_path(res.host, res.started)
    console = Console()
    written: Path | None = path
    try:
        report.write_json(res, path)
    except OSError as e:
        console.print(f"[red]could not write {path}: {e}[/]")
        written = None
    report.render(res, console, written)
    sys.exit(res.exit_code)


def _refuse(reason: str) -> NoReturn:
    """Exit 2 with the one line: this machine cannot run the kit."""
    click.echo(f"colloc selftest: {reason}", err=True)
    sys.exit(2)
