"""``replay.py --trace-file``: the trace CSV validator (issue 14)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_colloc.bench.trace_file import TraceFileError, load_trace_file, parse_trace_text

HEAD = "arrival_s,gpus,batch_size,peak_mib,work_s,summary,guess_mib,sm_pct"
GOOD = "0,1,32,3000,900,resnet18,4096,60"


def parse(text: str, **kw: object) -> tuple:
    args: dict = {"where": "t.csv", "gpus": 4, "gpu_mib": 40960, "summaries": {"resnet18"}}
    args.update(kw)
    return parse_trace_text(text, **args)


def problems(text: str, **kw: object) -> list[str]:
    with pytest.raises(TraceFileError) as e:
        parse(text, **kw)
    for p in e.value.problems:
        assert "\n" not in p and p.startswith("t.csv:")
    return e.value.problems


def test_minimal_file_defaults() -> None:
    (j,) = parse(f"{HEAD}\n{GOOD}\n")
    assert j.name == "t-000" and j.gpus == 1 and j.user == "" and j.summary == "resnet18"
    assert j.steady_mib == j.peak_mib == 3000 and j.peak_at == 0.0
    assert j.size_class == "light" and j.source == "t.csv:2"


def test_optional_columns_and_sorting() -> None:
    text = (f"{HEAD},name,user,steady_mib,peak_at,model\n"
            "50,2,64,20000,3600,,24576,90,big,colloc-r1,18000,0.2,bert\n"
            "5,1,32,3000,900,resnet18,4096,60,small,,2800,0.1,\n")
    a, b = parse(text)
    assert (a.name, b.name) == ("small", "big")  # by arrival
    assert b.gpus == 2 and b.user == "colloc-r1" and b.size_class == "heavy"
    assert b.model == "bert" and a.model == "resnet18"


def test_summary_may_be_a_file(tmp_path: Path) -> None:
    (tmp_path / "m.txt").write_text("summary")
    f = tmp_path / "tr.csv"
    f.write_text(f"{HEAD}\n0,1,8,3000,60,m.txt,4096,50\n")
    (j,) = load_trace_file(f).jobs
    assert j.summary == str(tmp_path / "m.txt")


@pytest.mark.parametrize(("row", "column", "says"), [
    ("-1,1,32,3000,900,,4096,60", "arrival_s", "must be >= 0"),
    ("0,5,32,3000,900,,4096,60", "gpus", "must be 1..4"),
    ("0,1.5,32,3000,900,,4096,60", "gpus", "not a whole number"),
    ("0,1,0,3000,900,,4096,60", "batch_size", "must be >= 1"),
    ("0,1,32,50000,900,,4096,60", "peak_mib", "must be 1..40960"),
    ("0,1,32,3000,0,,4096,60", "work_s", "must be > 0"),
    ("0,1,32,3000,nan,,4096,60", "work_s", "not a finite number"),
    ("0,1,32,3000,900,nosuch,4096,60", "summary", "neither a known model summary"),
    ("0,1,32,3000,900,,,60", "guess_mib", "empty"),
    ("0,1,32,3000,900,,4096,120", "sm_pct", "must be in (0, 100]"),
    ("0,1,32,3000,900,,4096,abc", "sm_pct", "is not a number"),
])
def test_bad_cells_name_line_and_column(row: str, column: str, says: str) -> None:
    (p,) = problems(f"{HEAD}\n{row}\n")
    assert p.startswith(f"t.csv:2: column {column}:") and says in p


def test_every_problem_is_reported() -> None:
    ps = problems(f"{HEAD}\n{GOOD}\n-1,9,32,3000,900,,4096,60\n0,1,32,3000,900,,4096,0\n")
    assert [p.split(": column ")[0] for p in ps] == ["t.csv:3", "t.csv:3", "t.csv:4"]


def test_header_problems() -> None:
    ps = problems("arrival_s,gpus,colour\n0,1,red\n")
    assert any("column batch_size: missing" in p for p in ps)
    assert any("column colour: unknown" in p for p in ps)
    assert problems("")[0] == ("t.csv:1: empty file: expected a header row with "
                               "arrival_s, gpus, batch_size, peak_mib, work_s, summary, "
                               "guess_mib, sm_pct")
    assert "no jobs" in problems(f"{HEAD}\n")[0]


def test_names_users_and_steady() -> None:
    text = (f"{HEAD},name,user,steady_mib\n"
            f"{GOOD},a,Root!,2000\n{GOOD},a,,4000\n")
    ps = problems(text)
    assert any(p == "t.csv:2: column user: 'Root!' is not a Unix user name" for p in ps)
    assert any(p.startswith("t.csv:3: column name: 'a' already used on line 2") for p in ps)
    assert any(p.startswith("t.csv:3: column steady_mib: 4000 is above peak_mib 3000")
               for p in ps)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(TraceFileError, match=r"cannot read"):
        load_trace_file(tmp_path / "missing.csv")


def test_replay_cli_exits_2_with_the_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "replay", Path(__file__).resolve().parents[2] / "benchmarks" / "replay.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    f = tmp_path / "bad.csv"
    f.write_text(f"{HEAD}\n0,1,32,3000,-5,,4096,60\n")
    assert mod.main(["--trace-file", str(f), "--validate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{f}:2: column work_s: -5 must be > 0"]
    f.write_text(f"{HEAD}\n{GOOD.replace('resnet18', '')}\n")
    assert mod.main(["--trace-file", str(f), "--validate"]) == 0
