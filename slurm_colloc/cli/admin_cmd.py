"""``colloc admin install|uninstall|gres-conf|doctor|collector-unit|...``: set up and
check a site."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import click

from slurm_colloc import config as config_mod
from slurm_colloc.cli import records_cmd
from slurm_colloc.gpu.backend import GpuBackendError
from slurm_colloc.site import doctor as doctor_mod
from slurm_colloc.site import install as site
from slurm_colloc.site import releases
from slurm_colloc.site.chain import read_hooks

slurm_conf_option = click.option(
    "--slurm-conf", type=click.Path(path_type=Path), default=None,
    help="slurm.conf of the site (default: $SLURM_CONF, then /etc/slurm/slurm.conf).",
)


def _slurm_conf(path: Path | None) -> Path:
    return path or Path(os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()).rstrip(".")


def _load_config() -> config_mod.CollocConfig:
    try:
        return config_mod.load()
    except config_mod.ConfigError as e:
        raise click.ClickException(str(e)) from e


def _supported_release() -> releases.SlurmRelease:
    """This host's Slurm release, or one line refusing it (exit 2).

    Install and doctor refuse an unsupported release before anything else: a plugin
    built for it would not match, and the Lua would write what it does not accept
    (or the reverse); the supported range lives in :mod:`slurm_colloc.site.releases`.
    """
    try:
        return releases.check_supported()
    except releases.ReleaseError as e:
        raise click.ClickException(str(e)) from e


@click.group()
def admin() -> None:
    """Install and check colloc's Slurm plugins (run as root on the controller)."""


lib_dir_option = click.option(
    "--lib-dir", type=click.Path(path_type=Path), default=Path("/usr/local/lib/slurm-colloc"),
    show_default=True, help="Where the SPANK plugin is installed (must exist on every node).",
)


def _site_settings(cfg: config_mod.CollocConfig, conf: Path, gpu_memory_mib: tuple[int, ...],
                   ) -> tuple[site.SiteSettings, list[site.NodeType]]:
    """Site settings (SlurmUser trusted besides root) and the node types to plan for;
    one clear error when the GPU size cannot be known here."""
    slurm_user = doctor_mod.read_conf(conf).get("slurmuser", "root") if conf.exists() else "root"
    try:
        uids = [0, pwd.getpwnam(slurm_user).pw_uid]
    except KeyError:
        uids = [0]
    try:
        settings = site.settings_from_config(
            cfg, gpu_memory_mib=min(gpu_memory_mib) if gpu_memory_mib else None,
            trusted_uids=uids)
        types = site.node_types(cfg, [*(gpu_memory_mib or [settings.gpu_memory_mib]),
                                      *(p.gpu_memory_mib for p in settings.shared_partitions)])
    except (site.InstallError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    except GpuBackendError as e:  # the controller often has no GPU to detect
        raise click.ClickException(
            f"gpu_memory_mib = 0 asks this host's GPUs for their size, and it has none "
            f"usable ({_one_line(e)}); pass --gpu-memory-mib (once per GPU size) or set "
            "gpu_memory_mib in colloc.conf") from e
    return settings, types


@admin.command()
@slurm_conf_option
@lib_dir_option
@click.option("--gpu-memory-mib", type=int, multiple=True,
              help="Memory of one GPU; repeat once per GPU size of the site (default: "
                   "colloc.conf, then detect via the backend). Lua filters use the smallest.")
@click.option("--slurm-include", type=click.Path(path_type=Path), default=None,
              help="Directory of Slurm's spank.h (default: $SLURM_INCLUDE_DIR, then "
                   "/usr/include/slurm, /usr/include/slurm-wlm, /usr/local/include/slurm).")
@click.option("--apply", "apply_", is_flag=True,
              help="Build the plugin and write the files; without it nothing is written.")
@click.option("--force", is_flag=True, help="Replace Lua filters not written by colloc.")
@click.option("--chain-job-submit", "chain_path", default=None,
              type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="The site's own job_submit.lua: embedded into colloc's (Slurm loads only "
                   "one), its slurm_job_submit/slurm_job_modify run first and a refusal of "
                   "theirs stands. Re-run install after changing it.")
@click.option("--chain-cli-filter", "cli_chain_path", default=None,
              type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="The site's own cli_filter.lua: embedded into colloc's (Slurm loads only "
                   "one), its slurm_cli_* functions run first and a failure of theirs "
                   "stands. Re-run install after changing it.")
def install(slurm_conf: Path | None, lib_dir: Path, gpu_memory_mib: tuple[int, ...],
            slurm_include: Path | None, apply_: bool, force: bool,
            chain_path: Path | None, cli_chain_path: Path | None) -> None:
    """Print (dry run) or, with --apply, write the site set-up, per role.

    A dry run by default: on a real controller a surprise write next to slurm.conf is
    read by slurmctld at the next reconfigure, so the admin reads the plan first.
    """
    conf = _slurm_conf(slurm_conf)
    cfg = _load_config()
    release = _supported_release()
    try:
        chain = site.load_site_job_submit(chain_path) if chain_path else None
        cli_chain = site.load_site_cli_filter(cli_chain_path) if cli_chain_path else None
    except site.InstallError as e:
        raise click.ClickException(str(e)) from e
    settings, types = _site_settings(cfg, conf, gpu_memory_mib)
    hooks = read_hooks(conf)  # the site's own Prolog/Epilog/plugin lists are kept
    try:
        headers: Path | None = site.find_spank_header(slurm_include)
        missing = ""
    except site.InstallError as e:
        headers, missing = None, str(e)
    if not apply_:
        click.echo(site.render_plan(conf.parent, lib_dir, settings, types, headers=headers,
                                    chain=chain, slurm_release=release, hooks=hooks,
                                    cli_chain=cli_chain), nl=False)
        if missing:
            click.echo(f"\nwarning: {missing}")
        return
    try:
        res = site.install(conf.parent, lib_dir, settings, force=force, include=slurm_include,
                           chain=chain, slurm_release=release, cli_chain=cli_chain)
    except site.InstallError as e:
        raise click.ClickException(str(e)) from e
    for p in res.written:
        click.echo(f"wrote {p}")
    click.echo(f"SPANK plugin built for Slurm {res.plugin_release or '(unknown headers)'}; "
               f"this host runs Slurm {release}")
    click.echo(f"\nshard = {settings.shard_mib} MiB, GPU = {settings.gpu_memory_mib} MiB, "
               f"{settings.jobs_mib} MiB for jobs ({settings.shards_per_gpu} shards), "
               f"estimator = {settings.estimator}")
    for line in site.scope_lines(settings, chain):
        click.echo(line)
    click.echo(f"\n# add to {conf} (then: scontrol reconfigure)")
    for line in site.site_slurm_conf(conf.parent, hooks=hooks):
        click.echo(line)
    for note in res.notes:
        click.echo(f"note: {note}")
    click.echo("\n# gres.conf: run `colloc admin gres-conf` on one node of each GPU type; "
               "copy the plugin and the Lua files to every login node and node")


@admin.command()
@slurm_conf_option
@lib_dir_option
@click.option("--apply", "apply_", is_flag=True, help="Remove the files; else only list them.")
def uninstall(slurm_conf: Path | None, lib_dir: Path, apply_: bool) -> None:
    """List (dry run) or, with --apply, remove the files colloc wrote.

    Only files carrying colloc's marker are touched: a site's own job_submit.lua or
    plugstack.conf at the same path is never removed. Take the slurm.conf lines out and
    `scontrol reconfigure` first: with JobSubmitPlugins=lua and no job_submit.lua,
    slurmctld rejects every submission.
    """
    conf = _slurm_conf(slurm_conf)
    plan = site.plan_uninstall(conf.parent, lib_dir)
    click.echo(f"# 1. remove from {conf}, then `scontrol reconfigure` (keep CliFilterPlugins/"
               "JobSubmitPlugins/PrologFlags if the site uses them otherwise):")
    for line in plan.slurm_conf_lines or ["(none found)"]:
        click.echo(line)
    verb = "removed" if apply_ else "would remove"
    how = "removing" if apply_ else "dry run; --apply removes them"
    click.echo(f"\n# 2. files colloc wrote ({how}):")
    if apply_:
        done = site.uninstall(plan)
        for p in done:
            click.echo(f"{verb} {p}")
    else:
        for p in plan.remove:
            click.echo(f"{verb} {p}")
    if not plan.remove:
        click.echo("(none found)")
    for p in plan.foreign:
        click.echo(f"kept {p} (not written by slurm-colloc)")
    for note in plan.notes:
        click.echo(f"note: {note}")
    click.echo("\n# 3. on every host: pip uninstall slurm-colloc (after the last colloc job ends)")


@admin.command("gres-conf")
@click.option("--device-pattern", default="/dev/nvidia{index}", show_default=True,
              help="Device file of GPU {index}.")
@click.option("--node-name", default=None, help="Prefix lines with NodeName=...")
def gres_conf(device_pattern: str, node_name: str | None) -> None:
    """Print per-GPU gpu and shard lines for gres.conf from this node's GPUs."""
    from slurm_colloc.gpu.select import gpus_from_config

    cfg = _load_config()
    try:
        gpus = gpus_from_config(cfg)
        text, node_gres = site.gres_conf_lines(gpus, cfg, device_pattern, node_name)
    except GpuBackendError as e:  # a controller or login host: no GPU, no NVML
        raise click.ClickException(
            f"cannot list this host's GPUs ({_one_line(e)}); run colloc admin gres-conf on "
            "a GPU node of each type") from e
    click.echo(text, nl=False)
    click.echo(f"# slurm.conf NodeName=... {node_gres}")


@admin.command()
@slurm_conf_option
@click.option("--offline", is_flag=True, help="Only check files; do not ask slurmctld.")
@click.option("--gpus", "check_gpus", is_flag=True,
              help="Also check this node's GPUs (backend, compute mode); run on a GPU node.")
@click.option("--submit-as", "submit_as", default="nobody", show_default=True,
              envvar="COLLOC_DOCTOR_USER",
              help="Unprivileged user for the test submission (sbatch --test-only "
                   "--colloc-mem=2G, through runuser when run as root); needs a Slurm "
                   "account where associations are enforced. Env: COLLOC_DOCTOR_USER.")
def doctor(slurm_conf: Path | None, offline: bool, check_gpus: bool, submit_as: str) -> None:
    """Check the submit path's configuration; exit 1 if anything is wrong.

    Without --offline it also submits a colloc job with --test-only as an unprivileged
    user: the question users will ask, answered by the running controller.
    """
    conf = _slurm_conf(slurm_conf)
    cfg = _load_config()
    release = _supported_release()
    findings = [doctor_mod.Finding("ok", "Slurm release", f"{release} (supported: "
                                   f"{releases.SUPPORTED_RANGE})")]
    findings += doctor_mod.check_files(conf, cfg, release)
    if not offline:
        findings += doctor_mod.check_live()
        findings.append(doctor_mod.check_submit(
            submit_as, conf if slurm_conf or os.environ.get("SLURM_CONF") else None))
    if check_gpus:
        findings += doctor_mod.check_gpus(cfg, conf.parent / "gres.conf")
        findings += doctor_mod.check_node(cfg, conf)
    for f in findings:
        mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}[f.level]
        click.echo(f"{mark} {f.what}" + (f": {f.detail}" if f.detail else ""))
    if any(f.level == "fail" for f in findings):
        raise SystemExit(1)


@admin.command("collector-unit")
@click.option("--install", "install_", is_flag=True,
              help="Write it to --unit-dir (root); else print it.")
@click.option("--unit-dir", type=click.Path(path_type=Path, file_okay=False),
              default=Path("/etc/systemd/system"), show_default=True,
              help="Where --install writes the unit.")
def collector_unit(install_: bool, unit_dir: Path) -> None:
    """Print (or --install) the systemd unit of the node collector, for this install.

    systemd then keeps the collector up (no idle exit) and restarts it if it dies;
    set collector_unit in colloc.conf so that prologs ask systemd for it.
    """
    from slurm_colloc.site import collector_unit as unit

    try:
        text = unit.render()
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    if not install_:
        click.echo(text, nl=False)
        return
    try:
        path = unit.install(unit_dir, text)
    except OSError as e:
        raise click.ClickException(f"{unit_dir / unit.UNIT_NAME}: not written: "
                                   f"{_one_line(e)}") from e
    click.echo(f"wrote {path}\nnext: systemctl daemon-reload && systemctl enable --now "
               f"{unit.UNIT_NAME}\nand in colloc.conf: collector_unit = \"{unit.UNIT_NAME}\"")


@admin.command("node-clients")
@click.option("--dest", type=click.Path(path_type=Path, file_okay=False),
              default=Path("/usr/local/lib/slurm-colloc"), show_default=True,
              help="Where the two programs are written (the same path on every GPU node).")
def node_clients(dest: Path) -> None:
    """Build the C clients of the node's script server for slurm.conf's Prolog/Epilog.

    Each hands slurmd's run to the node's resident script server in about a millisecond
    of CPU (the Python console script spends ~0.07 s on its interpreter first) and
    falls back to this installation's colloc-prolog/colloc-epilog whenever the server
    does not take it. Run it on every GPU node (it needs a C compiler), after each
    upgrade that moves the console scripts; then point slurm.conf at the printed paths.
    """
    from slurm_colloc.node import script_client_build as clients

    scripts = site.node_script_paths()
    lines = []
    for script, key in (("prolog", "Prolog"), ("epilog", "Epilog")):
        try:
            built = clients.build(dest / f"{clients.SCRIPTS[script]}-client", script,
                                  scripts[key])
        except (clients.BuildError, OSError) as e:
            raise click.ClickException(_one_line(e)) from e
        lines.append(f"{key}={built}")
    click.echo("built; in slurm.conf, in place of colloc's console scripts:\n" + "\n".join(lines))


@admin.command("compute-history")
@click.option("--days", type=click.IntRange(1, 3650), default=None,
              help="How far back to read finished jobs (default: history_days).")
@click.option("--write", "write_", is_flag=True,
              help="Replace compute_history_file (root, on the controller); else print.")
def compute_history(days: int | None, write_: bool) -> None:
    """Expected SM activity per user and model, for compute admission (sm_capacity_pct).

    Reads every user's completed jobs from Slurm's accounting and keeps, per (uid,
    model fingerprint), the largest mean SM activity of its newest complete runs.
    Run it as root from a timer (docs/admin.md, "Compute admission"); job_submit.lua
    rereads the file every minute.
    """
    from datetime import datetime, timedelta

    from slurm_colloc.accounting import compute_history as ch
    from slurm_colloc.slurm.adapter import SlurmCli, SlurmError

    cfg = _load_config()
    since = datetime.now() - timedelta(days=days or cfg.history_days)
    try:
        rows = SlurmCli().accounting_period(since.strftime("%Y-%m-%dT%H:%M:%S"))
    except SlurmError as e:
        raise click.ClickException(f"cannot read Slurm's accounting: {_one_line(e)}; the "
                                   "table is left as it was") from e
    table = ch.build_table(ch.measurements(rows, ch.uid_by_name, cfg.record_field))
    if not write_:
        click.echo(ch.render(table), nl=False)
        return
    path = Path(cfg.compute_history_file)
    try:
        ch.write(path, table)
    except (ch.ComputeHistoryError, OSError) as e:
        raise click.ClickException(f"{path}: not written: {_one_line(e)}") from e
    click.echo(f"{path}: {len(table)} (user, model) entries from {len(rows)} jobs")


@admin.command("gpu-shares")
@click.option("--since", default="now-1days", show_default=True,
              help="Jobs that ran since this time (sacct's --starttime syntax).")
@click.option("--until", default=None, help="... and before this time (sacct's --endtime).")
@click.option("--format", "fmt", type=click.Choice(["csv", "json"]), default="csv",
              show_default=True)
def gpu_shares(since: str, until: str | None, fmt: str) -> None:
    """Each job's fraction of a GPU (shards / shards per GPU), from Slurm's accounting.

    For a site's jobstats-style GPU accounting, which otherwise credits a whole GPU to
    each job on a shared one (docs/admin.md, "jobstats sites"). Columns: jobid, user,
    node, gpu, shards, shards_per_gpu, fraction.
    """
    from slurm_colloc.report import gpu_shares as gs
    from slurm_colloc.slurm.adapter import SlurmCli, SlurmError

    cfg = _load_config()
    try:
        rows = SlurmCli().accounting_period(since, until)
    except SlurmError as e:
        raise click.ClickException(f"cannot read Slurm's accounting: {_one_line(e)}") from e
    click.echo(gs.render(gs.shares(rows, cfg), fmt), nl=False)


admin.add_command(records_cmd.records)  # issue 28: the node's pending accounting records
