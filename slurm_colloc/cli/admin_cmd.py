"""``colloc admin install|gres-conf|doctor``: set up and check the submit path of a site."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import click

from slurm_colloc import config as config_mod
from slurm_colloc.site import doctor as doctor_mod
from slurm_colloc.site import install as site

slurm_conf_option = click.option(
    "--slurm-conf", type=click.Path(path_type=Path), default=None,
    help="slurm.conf of the site (default: $SLURM_CONF, then /etc/slurm/slurm.conf).",
)


def _slurm_conf(path: Path | None) -> Path:
    return path or Path(os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf")


def _load_config() -> config_mod.CollocConfig:
    try:
        return config_mod.load()
    except config_mod.ConfigError as e:
        raise click.ClickException(str(e)) from e


@click.group()
def admin() -> None:
    """Install and check colloc's Slurm plugins (run as root on the controller)."""


@admin.command()
@slurm_conf_option
@click.option("--lib-dir", type=click.Path(path_type=Path),
              default=Path("/usr/local/lib/slurm-colloc"), show_default=True,
              help="Where the SPANK plugin is installed (must exist on every node).")
@click.option("--gpu-memory-mib", type=int, default=None,
              help="Memory of one GPU (default: colloc.conf, then detect via the backend).")
@click.option("--force", is_flag=True, help="Replace Lua filters not written by colloc.")
def install(slurm_conf: Path | None, lib_dir: Path, gpu_memory_mib: int | None,
            force: bool) -> None:
    """Build the SPANK plugin, write cli_filter.lua, job_submit.lua, plugstack drop-in.

    Prints the slurm.conf lines to add; the Lua filters go next to slurm.conf.
    """
    conf = _slurm_conf(slurm_conf)
    cfg = _load_config()
    slurm_user = doctor_mod.read_conf(conf).get("slurmuser", "root") if conf.exists() else "root"
    try:
        uids = [0, pwd.getpwnam(slurm_user).pw_uid]
    except KeyError:
        uids = [0]
    try:
        settings = site.settings_from_config(cfg, gpu_memory_mib=gpu_memory_mib,
                                             trusted_uids=uids)
        res = site.install(conf.parent, lib_dir, settings, force=force)
    except site.InstallError as e:
        raise click.ClickException(str(e)) from e
    for p in res.written:
        click.echo(f"wrote {p}")
    click.echo(f"\nshard = {settings.shard_mib} MiB, GPU = {settings.gpu_memory_mib} MiB, "
               f"{settings.jobs_mib} MiB for jobs ({settings.shards_per_gpu} shards), "
               f"estimator = {settings.estimator}")
    click.echo(f"\n# add to {conf} (then: scontrol reconfigure)")
    for line in ["SelectType=select/cons_tres", "GresTypes=gpu,shard", *res.slurm_conf_lines]:
        click.echo(line)
    for note in res.notes:
        click.echo(f"note: {note}")
    click.echo("\n# gres.conf: see `colloc admin gres-conf`; copy the plugin and the Lua "
               "files to every login node and node")


@admin.command("gres-conf")
@click.option("--device-pattern", default="/dev/nvidia{index}", show_default=True,
              help="Device file of GPU {index}.")
@click.option("--node-name", default=None, help="Prefix lines with NodeName=...")
def gres_conf(device_pattern: str, node_name: str | None) -> None:
    """Print per-GPU gpu and shard lines for gres.conf from this node's GPUs."""
    from slurm_colloc.gpu.select import gpus_from_config

    cfg = _load_config()
    text, node_gres = site.gres_conf_lines(gpus_from_config(cfg), cfg, device_pattern, node_name)
    click.echo(text, nl=False)
    click.echo(f"# slurm.conf NodeName=... {node_gres}")


@admin.command()
@slurm_conf_option
@click.option("--offline", is_flag=True, help="Only check files; do not ask slurmctld.")
@click.option("--gpus", "check_gpus", is_flag=True,
              help="Also check this node's GPUs (backend, compute mode); run on a GPU node.")
def doctor(slurm_conf: Path | None, offline: bool, check_gpus: bool) -> None:
    """Check the submit path's configuration; exit 1 if anything is wrong."""
    conf = _slurm_conf(slurm_conf)
    cfg = _load_config()
    findings = doctor_mod.check_files(conf, cfg)
    if not offline:
        findings += doctor_mod.check_live()
    if check_gpus:
        findings += doctor_mod.check_gpus(cfg, conf.parent / "gres.conf")
    for f in findings:
        mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}[f.level]
        click.echo(f"{mark} {f.what}" + (f": {f.detail}" if f.detail else ""))
    if any(f.level == "fail" for f in findings):
        raise SystemExit(1)
