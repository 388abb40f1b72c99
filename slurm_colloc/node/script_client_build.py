"""Build the C client of the node's script server (``script_client.c``) for one script.

Why (issue 28, prolog p99 under a burst): the Python client (``colloc-prolog``) spends
~0.07 s of CPU on its interpreter and imports before its request reaches the node's
script server; on a node's cores under a burst of ~40 prologs that start-up was the
largest part of the slowest prologs' wait. The C client hands over in about a
millisecond and falls back to the Python script (``--not-served WHY``) whenever the
server does not take the run, so it changes nothing a job sees.

slurm.conf then points ``Prolog=``/``Epilog=`` at the built programs (the devcluster and
``colloc admin node-clients`` build them with the node's C compiler).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

SCRIPTS = {"prolog": "colloc-prolog", "epilog": "colloc-epilog"}
"""Script -> the console script it falls back to (and the name of the built client)."""
CFLAGS = ("-Wall", "-Wextra", "-Werror", "-O2", "-fstack-protector-strong",
          "-D_FORTIFY_SOURCE=2")


class BuildError(RuntimeError):
    """The client could not be built (no compiler, a path C cannot hold, a compile error)."""


def _c_string(value: str) -> str:
    if any(c in value for c in '"\\\n\r\0') or not value.isprintable() or \
            any(c.isspace() for c in value):
        raise BuildError(f"{value!r}: cannot be compiled into the client")
    return f'"{value}"'


def build(dest: Path, script: str, fallback: Path, *, run_dir: Path | None = None,
          cc: str | None = None) -> Path:
    """Compile the client of ``script`` (``prolog``/``epilog``) into ``dest`` (0755,
    replaced atomically: a running slurmd never execs half a file). ``fallback``: the
    absolute path of the Python console script it execs when not served; ``run_dir``:
    the servers' directory (tests; default ``script_client.RUN_DIR``)."""
    if script not in SCRIPTS:
        raise BuildError(f"{script}: not a root script ({', '.join(SCRIPTS)})")
    if not fallback.is_absolute():
        raise BuildError(f"{fallback}: the fallback must be an absolute path")
    compiler = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise BuildError("no C compiler found (apt-get install gcc)")
    from slurm_colloc.priority import SCRIPT_NICE

    defines = [f"-DCOLLOC_SCRIPT={_c_string(script)}",
               f"-DCOLLOC_FALLBACK={_c_string(str(fallback))}", f"-DCOLLOC_NICE=({SCRIPT_NICE})"]
    if run_dir is not None:
        defines.append(f"-DCOLLOC_RUN_DIR={_c_string(str(run_dir))}")
    if not os.access(fallback, os.X_OK):  # a client that cannot fall back runs nothing
        raise BuildError(f"{fallback}: not an executable (install slurm-colloc first)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="colloc-client-") as tmp:
        src = Path(tmp) / "script_client.c"
        src.write_text(resources.files("slurm_colloc.node").joinpath("script_client.c")
                       .read_text(encoding="utf-8"))
        out = Path(tmp) / "client"
        cp = subprocess.run([compiler, *CFLAGS, *defines, "-o", str(out), str(src)],
                            capture_output=True, text=True, check=False)
        if cp.returncode != 0:
            raise BuildError(f"compiling the {script} client failed:\n{cp.stderr.strip()}")
        tmp_dest = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
        shutil.copyfile(out, tmp_dest)
        tmp_dest.chmod(0o755)
        os.replace(tmp_dest, dest)
    return dest
