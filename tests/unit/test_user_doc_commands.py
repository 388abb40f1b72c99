"""Every command in docs/user.md is run by a test: the ones that need only colloc here,
the ones that need a cluster in tests/e2e/test_checkpoint_resume.py. A command added
to or changed in the guide fails this test until it is given to one of them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
USER_MD = ROOT / "docs" / "user.md"
SUMMARY = ROOT / "sbatch_templates" / "summaries" / "resnet50_torchinfo_depth10.txt"

UNIT = {
    "summary": "python -c 'import torchinfo, timm;",
    "estimate": "colloc estimate --summary resnet50.txt --batch-size 64 --optimizer adamw "
                "--precision amp-bf16",
}
"""Run here (the summary one-liner needs torch and timm: its Python is compiled and
its output file, resnet50.txt, is stood in for by the shipped depth-10 torchinfo
summary)."""
E2E = {
    "sbatch_colloc": "sbatch --colloc=resnet50.txt --colloc-batch-size=64 "
                     "--colloc-optimizer=adamw train.sh",
    "sbatch_mem": "sbatch --colloc-mem=12G train.sh",
    "report": "colloc-report <jobid>",
    "report_html": "colloc-report <jobid> --html r.html",
    "report_json": "colloc-report <jobid> --json",
    "report_array": "colloc-report 1234_7",
    "table": "colloc-report -u $USER -S now-7days",
    "table_states": "colloc-report -u $USER -s CD,F --json",
    "sacct_restarts": "sacct -j <jobid> -o JobID,State,Restarts,AllocTRES",
    "sacct_duplicates": "sacct -j <jobid> --duplicates -o JobID,State,Start,End,AllocTRES",
}
"""Run against the devcluster by tests/e2e/test_checkpoint_resume.py."""


def doc_commands(path: Path = USER_MD) -> list[str]:
    """The commands of the guide's ``sh`` blocks, one a line, comments removed."""
    out = []
    for block in re.findall(r"^```sh\n(.*?)^```$", path.read_text(), re.S | re.M):
        for line in block.splitlines():
            cmd = re.sub(r"\s+#(?!\S*').*$", "", line).strip()
            if cmd:
                out.append(cmd)
    return out


def kind(cmd: str) -> tuple[str, str]:
    """("unit" or "e2e", key) of a guide command; AssertionError for one no test runs."""
    for where, table in (("unit", UNIT), ("e2e", E2E)):
        for key, known in table.items():
            if cmd == known or (key == "summary" and cmd.startswith(known)):
                return where, key
    raise AssertionError(f"docs/user.md: no test runs {cmd!r}: add it to "
                         "tests/unit/test_user_doc_commands.py (UNIT or E2E)")


def test_every_command_of_the_guide_is_run_by_a_test() -> None:
    cmds = doc_commands()
    assert len(cmds) == len(UNIT) + len(E2E), cmds
    assert sorted(kind(c)[1] for c in cmds) == sorted([*UNIT, *E2E])


def test_the_summary_one_liner_is_python_that_writes_resnet50_txt(tmp_path: Path) -> None:
    (cmd,) = [c for c in doc_commands() if kind(c)[1] == "summary"]
    m = re.fullmatch(r"python -c '(.*)' > resnet50\.txt", cmd)
    assert m, cmd
    compile(m.group(1), "docs/user.md", "exec")
    # depth=10, as the guide says: the default depth 3 widens the estimate's margin
    assert "torchinfo.summary(" in m.group(1) and "depth=10, verbose=0" in m.group(1)


def test_the_estimate_command_runs_on_the_summary(tmp_path: Path) -> None:
    (cmd,) = [c for c in doc_commands() if kind(c)[1] == "estimate"]
    shutil.copy(SUMMARY, tmp_path / "resnet50.txt")
    colloc = Path(sys.executable).parent / "colloc"
    argv = [str(colloc), *cmd.split()[1:], "--no-history"]
    cp = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                        check=False)
    assert cp.returncode == 0, cp.stderr
    assert re.match(r"\d+ MiB \(layer-aware", cp.stdout), cp.stdout
    assert "depth=10" not in cp.stdout  # no advice to redo the summary
