"""contrib/grafana/colloc-dashboard.json: a dashboard Grafana can import, whose queries
name only metrics the collector's exporter writes (the e2e runs each through Prometheus)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from slurm_colloc.metrics import enforce, node_counters
from tests.unit.test_prometheus_export import cfg_for, exporter, meta, row

DASHBOARD = Path(__file__).resolve().parents[2] / "contrib" / "grafana" / "colloc-dashboard.json"
PANEL_TYPES = {"timeseries", "stat", "table", "gauge", "bargauge"}
VARIABLES = {"$node": ".*", "$user": ".*", "$jobid": ".*", "$__range": "1h",
             "$__rate_interval": "1m", "$__interval": "1m"}
"""Grafana's variables as a query of every value (``All``) would fill them in."""
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
            "or", "unless", "offset"}


def load() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def exprs(dash: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and variable queries."""
    out = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            out.append(v["query"]["query"])
    return out


def concrete(expr: str) -> str:
    """``expr`` with Grafana's variables filled in (what Prometheus is sent)."""
    for name in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, VARIABLES[name])
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (or a ``label_values(metric, label)`` query)."""
    m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", expr)
    if m:
        return {m.group(1)}
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # ranges
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        rest = s[m.end():].lstrip()
        if m.group(0) not in KEYWORDS and not rest.startswith("("):
            names.add(m.group(0))
    return names


def exported_names(tmp_path: Path) -> set[str]:
    """Sample names the exporter writes when everything it knows is present."""
    cfg = cfg_for(tmp_path)
    meta(cfg, 42)
    enforce.write_verdict(cfg.metrics_dir, enforce.Verdict(
        job_id="42", attempt=0, uid=os.getuid(), gpu=1, kind=enforce.OVER_LIMIT, peak_mib=1,
        limit_mib=1, first_seen=1.0, last_seen=1.0, action=enforce.KILLED))
    node_counters.bump(cfg.metrics_dir, {"gpu_oom": 1, "requeues": 1})
    text = exporter(cfg).text({("42", 0): {1: row()}})
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_dashboard_is_valid_grafana_json() -> None:
    dash = load()
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and len(ids) >= 8
    for p in dash["panels"]:
        assert p["type"] in PANEL_TYPES and p["title"], p
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")) and g["x"] + g["w"] <= 24
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["datasource"]["type"] == "prometheus" and t["expr"].strip()
    for e in exprs(dash):
        used = set(re.findall(r"\$(\w+)", e))
        assert used <= set(variables) | {"__range", "__rate_interval", "__interval"}, e
        assert "$" not in concrete(e), e


def test_every_metric_a_panel_queries_is_exported(tmp_path: Path) -> None:
    exported = exported_names(tmp_path)
    used: set[str] = set()
    for e in exprs(load()):
        names = metric_names(e)
        assert names, f"no metric in {e!r}"
        assert names <= exported, f"{e!r}: {sorted(names - exported)} not exported"
        used |= names
    # the dashboard shows what the issue asks for: sizes, usage, activity, verdicts, events
    for name in ("colloc_job_shards", "colloc_job_memory_limit_bytes",
                 "colloc_job_memory_used_bytes", "colloc_job_gpu_sm_activity_percent",
                 "colloc_job_gpu_power_watts", "colloc_verdicts", "colloc_gpu_oom_total",
                 "colloc_requeues_total"):
        assert name in used, name


def test_name_extraction_finds_names_and_skips_functions_labels_and_keywords() -> None:
    assert metric_names('sum by (node, gpu) (a_b{node=~"$node"}) / on(job) c[5m]') == {
        "a_b", "c"}
    assert metric_names("max(time() - colloc_x{node=~\"by\"})") == {"colloc_x"}
    assert metric_names("label_values(colloc_y, user)") == {"colloc_y"}
    assert "$" not in concrete('increase(x{node=~"$node"}[$__range])')
