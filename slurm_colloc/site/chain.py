"""slurm.conf lines that keep a site's own hooks and add colloc's (``colloc admin install``).

A GPU site already runs things colloc must not push aside: health-check prologs,
jobstats' prolog, OpenHPC's epilog clean-up, a cli_filter or job_submit plugin list.
Slurm's own syntax carries both:

* ``Prolog`` and ``Epilog`` may be given on several lines (and as a glob such as
  ``/etc/slurm/prolog.d/*``); slurmd runs every script and the job fails as Slurm
  intends when any of them fails. The site's lines stay as they are; colloc's is one
  more line.
* ``TaskProlog`` takes one script. colloc's replaces the site's and runs it first
  (colloc.conf ``chain_task_prolog``, :mod:`slurm_colloc.node.chain`).
* ``CliFilterPlugins``, ``JobSubmitPlugins`` and ``PrologFlags`` are comma-separated
  lists: the site's entries are kept and colloc's added. A site whose list already holds
  ``lua`` has its own .lua script: ``--chain-cli-filter`` / ``--chain-job-submit``
  embed it in colloc's.

Pure functions over slurm.conf's text; nothing here writes.
"""

from __future__ import annotations

import glob
from collections.abc import Mapping, Sequence
from pathlib import Path

MULTI_LINE = ("Prolog", "Epilog")
"""Keys Slurm reads from every line that sets them (each a script or a glob)."""
LISTS = ("CliFilterPlugins", "JobSubmitPlugins", "PrologFlags")
"""Comma-separated keys: colloc's entries are added to the site's."""
LUA_CHAIN = {"CliFilterPlugins": "--chain-cli-filter", "JobSubmitPlugins": "--chain-job-submit"}
"""Plugin lists whose ``lua`` entry loads one script: a site's is embedded in colloc's."""
_SKIP = ("nodename", "partitionname", "nodeset", "frontendname", "downnodes")

Hooks = Mapping[str, Sequence[str]]
"""slurm.conf key (lowercase) -> every value it is set to, in file order."""


def conf_values(text: str) -> dict[str, list[str]]:
    """Every ``Key=Value`` of slurm.conf's text: lowercase key -> values in order.

    Several pairs on one line count (Slurm reads them so); node, partition and
    nodeset lines are skipped (their keys are theirs, not the cluster's).
    """
    out: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.lower().startswith(_SKIP):
            continue
        for word in line.split():
            key, eq, value = word.partition("=")
            if eq and key:
                out.setdefault(key.lower(), []).append(value.strip("\"'"))
    return out


def read_hooks(slurm_conf: Path) -> dict[str, list[str]]:
    """:func:`conf_values` of the site's slurm.conf; empty when it cannot be read."""
    try:
        return conf_values(slurm_conf.read_text(errors="replace"))
    except OSError:
        return {}


def scripts(hooks: Hooks, key: str) -> list[str]:
    """The programs a Prolog/Epilog/TaskProlog key names, globs expanded (sorted)."""
    out: list[str] = []
    for value in hooks.get(key.lower(), ()):
        found = sorted(glob.glob(value)) if glob.has_magic(value) else [value]
        out += [p for p in found if p not in out]
    return out


def is_colloc(path: str, name: str) -> bool:
    """Whether ``path`` is colloc's node script ``name`` (by file name)."""
    return Path(path).name == name


def node_scripts(hooks: Hooks, key: str) -> list[str]:
    """What slurmd runs for ``key``: every Prolog/Epilog line (globs expanded), the
    last TaskProlog (Slurm takes one)."""
    if key in MULTI_LINE:
        return scripts(hooks, key)
    last = list(hooks.get(key.lower(), ()))[-1:]
    return scripts({key.lower(): last}, key)


def colloc_among(paths: Sequence[str], name: str) -> str | None:
    """colloc's script among ``paths``: the one named ``name``; else the only one (a
    site's wrapper around colloc's); None when several and none is colloc's by name."""
    ours = [p for p in paths if is_colloc(p, name)]
    if ours:
        return ours[0]
    return paths[0] if len(paths) == 1 else None


def merged_list(site: Sequence[str], ours: Sequence[str]) -> str:
    """The site's comma-separated entries (last setting) with colloc's appended."""
    entries = [e.strip() for e in (site[-1] if site else "").split(",") if e.strip()]
    lowered = {e.lower() for e in entries}
    return ",".join(entries + [o for o in ours if o.lower() not in lowered])


def node_script_lines(hooks: Hooks, ours: Mapping[str, Path]) -> list[str]:
    """Prolog/Epilog/TaskProlog lines: colloc's, with what happens to the site's."""
    out: list[str] = []
    for key, path in ours.items():
        site = [v for v in hooks.get(key.lower(), ()) if not is_colloc(v, path.name)]
        if site and key in MULTI_LINE:
            out.append(f"# {key}: keep your {', '.join(f'{key}={v}' for v in site)} as "
                       f"it is: slurmd runs every {key}= line, and a failing one fails "
                       "the job as before; colloc's is one more line")
        elif site:
            out += [f"# {key}: Slurm runs one; this line replaces your {key}={site[-1]},",
                    f"# which colloc's runs first: in colloc.conf set chain_task_prolog = "
                    f"\"{site[-1]}\" (root-owned; uninstall: put your line back)"]
        out.append(f"{key}={path}")
    return out


def list_line(hooks: Hooks, key: str, ours: Sequence[str]) -> list[str]:
    """``Key=`` with the site's entries kept, and what uninstall must put back."""
    site = list(hooks.get(key.lower(), ()))
    merged = merged_list(site, ours)
    if not site:
        return [f"{key}={merged}"]
    out = []
    if merged != site[-1]:
        out.append(f"# {key}: your {site[-1] or '(empty)'} kept, colloc's {','.join(ours)} "
                   f"added (uninstall: put back {key}={site[-1]})")
    if key in LUA_CHAIN and "lua" in (e.strip().lower() for e in site[-1].split(",")):
        out.append(f"# {key}=lua already: unless that .lua is colloc's, pass it to install "
                   f"with {LUA_CHAIN[key]} PATH so that it keeps running inside colloc's")
    return [*out, f"{key}={merged}"]
