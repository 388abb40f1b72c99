"""Architecture checks run by ``make lint`` (issue 17): imports point down, no cycles,
no long runtime functions.

1. **Layers.** Each package of ``slurm_colloc`` sits in a layer; a module imports only
   from its own layer or lower ones (any import statement, lazy ones included). The
   lab (devcluster, demo, bench, simulation) sits on top and may use anything; the
   runtime never imports it (one exception: ``gpu/select.py`` builds the simulated
   backend when colloc.conf names it).
2. **No cycles** between modules (lazy imports count: a cycle hidden in a function
   is still a cycle a reader has to untangle).
3. **Function length.** No runtime function is over :data:`MAX_LINES` lines, except
   the table-driven parsers listed in :data:`LONG_OK`.

Exit 1 with one line per finding; 0 when clean.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "slurm_colloc"

LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"units", "procfs", "waits", "priority", "slurmd_watch", "root_lock", "config",
               "__version__", "__init__", "detach", "safe_tree", "owner_read", "log_escape",
               "log_handlers", "estimators", "hostlist", "gpu_settings"}),
    frozenset({"slurm", "gpu", "oom", "mps"}),
    frozenset({"accounting"}),
    frozenset({"metrics"}),
    frozenset({"node"}),
    frozenset({"report", "site", "selftest"}),
    frozenset({"cli", "demo", "demo_site", "demo_attacks", "demo_faults", "demo_monitoring",
               "devcluster",
               "bench", "gpu.sim"}),
)
LAB = frozenset({"demo", "demo_site", "demo_attacks", "demo_faults", "demo_monitoring",
                 "devcluster", "bench",
                 "gpu.sim"})
"""Lab units: no layer rule (they sit on top) and no length rule; the CLI shares their
layer but is runtime."""
ALLOWED_UP = {("slurm_colloc.gpu.select", "gpu.sim")}
MAX_LINES = 60
LONG_OK = {
    # table-driven parsers: one branch per row format of the tool they read
    "slurm_colloc.estimators.parsers.pytorch_print.parse",
    "slurm_colloc.estimators.parsers.torchinfo.parse",
    "slurm_colloc.estimators.parsers.flax.parse",
}


def unit_of(module: str) -> str | None:
    """The layer unit of a dotted module name (``gpu.sim`` is its own unit)."""
    parts = module.split(".")
    if parts[0] != "slurm_colloc" or len(parts) < 2:
        return None
    if parts[1] == "gpu" and len(parts) > 2 and parts[2] == "sim":
        return "gpu.sim"
    return parts[1]


def layer(unit: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise KeyError(unit)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module an import statement of ``path`` names (``from a import b``: a and
    a.b, whichever is a module)."""
    out: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module)
            out |= {f"{n.module}.{a.name}" for a in n.names}
    return out


def sources() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def check_layers(mods: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(mods.items()):
        me = unit_of(mod)
        if me is None or me in LAB:
            continue
        for dep in sorted(deps):
            them = unit_of(dep)
            if them is None or them == me or (mod, them) in ALLOWED_UP:
                continue
            if layer(them) > layer(me):
                bad.append(f"layers: {mod} ({me}) imports {dep} ({them}, a higher layer)")
    return bad


def check_cycles(mods: dict[str, set[str]]) -> list[str]:
    graph = {m: {d for d in deps if d in mods and d != m} for m, deps in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[str] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan, iterative over the edges of v
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append("cycle: " + " <-> ".join(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def check_lengths(paths: list[Path]) -> list[str]:
    bad = []
    for path in paths:
        mod = module_name(path)
        unit = unit_of(mod)
        if unit in LAB or "slurm_colloc.estimators.data" in mod:
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (n.end_lineno or n.lineno) - n.lineno + 1
                if length > MAX_LINES and f"{mod}.{n.name}" not in LONG_OK:
                    bad.append(f"length: {mod}.{n.name} is {length} lines "
                               f"({path.relative_to(ROOT)}:{n.lineno}; at most {MAX_LINES})")
    return bad


def main() -> int:
    paths = sources()
    mods = {module_name(p): imports(p) for p in paths}
    findings = check_layers(mods) + check_cycles(mods) + check_lengths(paths)
    for f in findings:
        sys.stdout.write(f + "\n")
    sys.stderr.write(f"architecture: {len(mods)} modules, {len(findings)} findings\n")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
