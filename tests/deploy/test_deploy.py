"""deploy/: the dashboard and the alert rules name only metrics the worker exports; promtool accepts
the rules (where promtool is installed); the systemd unit and the Dockerfile keep what the docs promise."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from shmrpc.server.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "shmrpc-dashboard.json"
RULES = DEPLOY / "prometheus" / "shmrpc-alerts.yml"

#: PromQL words that look like metric names: functions, aggregations, keywords.
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "delta", "histogram_quantile", "by", "without",
    "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset", "label_values",
    "topk", "bottomk", "quantile", "abs", "clamp_min", "clamp_max", "time", "vector", "scalar", "sort", "sort_desc",
    "avg_over_time", "max_over_time", "min_over_time", "absent", "le", "e",
}


def exported_metrics() -> set[str]:
    """Every sample name a worker's registry exposes (histograms with their _bucket/_count/_sum)."""
    m = Metrics()
    m.set_budgets(0.0005, {})  # the request below runs past it: shmrpc_over_budget_total has a sample
    m.observe("matmul", "ok", 0.001, 10, 10, {"queue": 1e-5, "h2d": 1e-5, "kernel": 1e-4, "d2h": 1e-5})
    m.observe_batch("matmul", 4)
    m.set_build_info("0", "numpy", "cpu")
    names = set()
    for family in m.registry.collect():
        names |= {s.name for s in family.samples}
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads: identifiers left after label matchers, ranges, groupings,
    strings and numbers are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\b\d+(\.\d+)?([eE][-+]?\d+)?\b", "", expr)
    return {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr) if w not in PROMQL_WORDS}


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"].replace("label_values(", "").split(",")[0])
    return exprs


def test_metric_name_parser() -> None:
    expr = 'histogram_quantile(0.99, sum by (op, le) (rate(shmrpc_x_bucket{op="a",le!="1"}[5m]))) > 0.1 and up == 0'
    assert metric_names(expr) == {"shmrpc_x_bucket", "up"}


def test_dashboard_queries_name_only_exported_metrics() -> None:
    exported = exported_metrics()
    exprs = _dashboard_exprs()
    assert len(exprs) >= 12
    used = set().union(*(metric_names(e) for e in exprs))
    assert used <= exported, sorted(used - exported)
    for wanted in ("shmrpc_requests_total", "shmrpc_request_duration_seconds_bucket", "shmrpc_pool_slots_held",
                   "shmrpc_clients_connected", "shmrpc_resident_bytes", "shmrpc_gpu_memory_bytes",
                   "shmrpc_batch_size_count"):
        assert wanted in used, wanted


def _rules() -> list[dict[str, str]]:
    rules: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    lines = RULES.read_text().splitlines()
    i = 0
    while i < len(lines):  # a small reader for this file's shape (no YAML library in the dependencies)
        line = lines[i]
        if line.strip().startswith("- alert:"):
            current = {"alert": line.split(":", 1)[1].strip()}
            rules.append(current)
        elif current is not None and line.strip().startswith("expr:"):
            value = line.split(":", 1)[1].strip()
            if value == "|":
                block, indent = [], len(line) - len(line.lstrip()) + 1
                while i + 1 < len(lines) and lines[i + 1].startswith(" " * indent):
                    i += 1
                    block.append(lines[i].strip())
                value = " ".join(block)
            current["expr"] = value
        i += 1
    return rules


def test_alert_rules_name_only_exported_metrics() -> None:
    rules = _rules()
    assert {r["alert"] for r in rules} == {"ShmrpcWorkerDown", "ShmrpcWorkerNotReady", "ShmrpcErrorRatioHigh",
                                           "ShmrpcP99LatencyHigh", "ShmrpcSlotsExhausted", "ShmrpcResidentLimitNear",
                                           "ShmrpcOpOverBudget"}
    # the pool's exhaustion is the pool's slots held against its size (the slots of clients' own regions, counted in
    # shmrpc_slots_leased, once made it fire with every pool slot free)
    slots = next(r["expr"] for r in rules if r["alert"] == "ShmrpcSlotsExhausted")
    assert metric_names(slots) == {"shmrpc_pool_slots_held", "shmrpc_slots_total"}
    exported = exported_metrics() | {"up"}  # `up` is Prometheus's own, per scrape target
    for r in rules:
        names = metric_names(r["expr"])
        assert names and names <= exported, (r["alert"], sorted(names - exported))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_checks_the_rules() -> None:
    out = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 7 rules found" in out.stdout


def test_systemd_unit_and_drop_in() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "shmrpc@.service")
    svc = unit["Service"]
    assert svc["LimitMEMLOCK"] == "infinity"
    assert "shmrpc serve --name %i" in svc["ExecStart"]
    assert svc["KillSignal"] == "SIGTERM" and svc["Restart"] == "on-failure"
    # a supervisor (--devices) waits 30 s for its workers: the stop timeout leaves it that; CuPy's kernel cache is
    # writable under ProtectSystem=strict / ProtectHome=read-only (its default, ~/.cupy, is not)
    assert int(svc["TimeoutStopSec"]) > 30
    assert svc["CacheDirectory"] == "shmrpc" and svc["Environment"] == "CUPY_CACHE_DIR=/var/cache/shmrpc/cupy"
    drop = configparser.ConfigParser(strict=False, interpolation=None)
    drop.optionxform = str  # type: ignore[assignment,method-assign]
    drop.read(DEPLOY / "systemd" / "shmrpc@.service.d" / "runtime-dir.conf")
    assert drop["Service"]["RuntimeDirectory"] == "shmrpc" and drop["Service"]["RuntimeDirectoryMode"] == "0700"
    assert "SHMRPC_RUNTIME_DIR=/run/shmrpc" in drop["Service"]["Environment"]


def test_dockerfile_health_check_and_limits() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+", text, re.M)
    health = re.search(r"^HEALTHCHECK .*\n\s+CMD (.*)$", text, re.M)
    assert health and health.group(1).startswith("shmrpc status --name") and "-q" in health.group(1)
    assert "--ulimit memlock=-1" in text
    run = re.search(r"^#\s+docker run (.*\n#\s+.*)$", text, re.M)  # the regions are memfds: no IPC namespace, no /dev/shm
    assert run and "--ipc" not in run.group(1) and "--shm-size" not in run.group(1)
    assert '"/src[gpu]"' in text
    assert re.search(r"CUPY_CACHE_DIR=(\S+)", text) and "chown -R shmrpc:shmrpc /var/cache/shmrpc" in text
