"""The PromQL of the Grafana dashboard and of docs/operations.md, and a real Prometheus to run
it on.

- ``dashboard_queries`` / ``doc_queries`` collect every query, with where it came from;
  ``check_dashboard`` checks the dashboard JSON's shape (datasource, targets, unique ids).
- ``Prometheus`` runs Debian's ``prometheus`` binary on a free port with a config derived from
  ``deploy/prometheus.yml`` (same jobs, credentials and paths; local targets; 1 s scrapes).
- ``evaluate`` runs one query through ``/api/v1/query``, Grafana's variables replaced by values;
  a query "has data" when at least one of its samples is a number (not NaN), so a misspelt
  metric (no series) and a ratio of nothing over nothing (NaN) both count as none.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support import end_process

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = ROOT / "deploy" / "grafana" / "dashboards"
PROMETHEUS_FILE = ROOT / "deploy" / "prometheus.yml"
PROMQL_DOC = ROOT / "docs" / "operations.md"
DATASOURCE_UID = "cachetier-prometheus"
# Grafana's built-in interval variables, as a Prometheus range.
BUILTIN_VARIABLES = {"__rate_interval": "5m", "__interval": "1m", "__range": "5m"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
# Prometheus's log line of the port its --web.listen-address=...:0 became.
_LISTENING = re.compile(r'msg="Listening on" address=127\.0\.0\.1:(\d+)')
_FENCE = re.compile(r"^```promql[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_INLINE = re.compile(r"`([^`\n]+)`")
_LABEL_VALUES = re.compile(r"^label_values\((?:(.+),\s*)?(\w+)\)$")


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL query and where it is (``panel 3 "TTFT" B``, ``docs/operations.md:51``)."""

    where: str
    expr: str


@dataclass(frozen=True, slots=True)
class Answer:
    """What Prometheus said to one query."""

    query: Query
    expr: str  # as sent, variables replaced
    num_series: int
    num_numbers: int  # samples that are numbers, not NaN
    error: str | None = None
    values: tuple[float, ...] = ()

    @property
    def has_data(self) -> bool:
        return self.error is None and self.num_numbers > 0


def load_dashboards(folder: Path = DASHBOARD_DIR) -> dict[str, dict[str, Any]]:
    """Every dashboard JSON of ``folder`` by file name."""
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def all_panels(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Panels, those inside collapsed rows included."""
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def check_dashboard(dashboard: Mapping[str, Any]) -> list[str]:
    """What is wrong with a dashboard's structure (empty: nothing)."""
    problems = []
    for key in ("uid", "title", "schemaVersion", "panels"):
        if key not in dashboard:
            problems.append(f"the dashboard has no {key!r}")
    ids = [p.get("id") for p in all_panels(dashboard)]
    if len(ids) != len(set(ids)) or None in ids:
        problems.append(f"panel ids must be present and unique, got {ids}")
    for panel in all_panels(dashboard):
        if panel.get("type") == "row":
            continue
        name = f"panel {panel.get('id')} {panel.get('title')!r}"
        if panel.get("datasource", {}).get("uid") != DATASOURCE_UID:
            problems.append(f"{name} does not use the datasource {DATASOURCE_UID!r}")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{name} has no targets")
        ref_ids = [t.get("refId") for t in targets]
        if len(ref_ids) != len(set(ref_ids)):
            problems.append(f"{name} repeats a refId: {ref_ids}")
        for target in targets:
            if not str(target.get("expr", "")).strip():
                problems.append(f"{name} target {target.get('refId')} has no expr")
        if "gridPos" not in panel:
            problems.append(f"{name} has no gridPos")
    return problems


def dashboard_queries(dashboard: Mapping[str, Any]) -> list[Query]:
    """Every panel target's ``expr``."""
    return [
        Query(f"panel {p['id']} {p.get('title')!r} {t.get('refId')}", t["expr"])
        for p in all_panels(dashboard)
        for t in p.get("targets", [])
        if "expr" in t
    ]


def dashboard_variables(dashboard: Mapping[str, Any]) -> dict[str, str]:
    """Each query variable's ``label_values(...)`` query, by variable name."""
    out = {}
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            out[var["name"]] = query.get("query") if isinstance(query, dict) else query
    return out


def doc_queries(text: str, name: str = "docs/operations.md") -> list[Query]:
    """The PromQL of a docs page: each query of a fenced ``promql`` block (queries are separated
    by blank lines; ``#`` lines are comments), and each inline code span that calls a function
    on a ``cachetier_`` metric."""
    out = []
    for block in _FENCE.finditer(text):
        first_line = text.count("\n", 0, block.start(1)) + 1
        lines: list[str] = []
        start = first_line
        for offset, line in enumerate([*block.group(1).splitlines(), ""]):
            stripped = line.strip()
            if stripped.startswith("#"):
                continue
            if stripped:
                start = start if lines else first_line + offset
                lines.append(stripped)
            elif lines:
                out.append(Query(f"{name}:{start}", " ".join(lines)))
                lines = []
    fenced = [(m.start(), m.end()) for m in re.finditer(r"^```.*?^```", text, re.M | re.S)]
    for span in _INLINE.finditer(text):
        if any(a <= span.start() < b for a, b in fenced):
            continue
        code = span.group(1)
        if "cachetier_" in code and "(" in code:
            out.append(Query(f"{name}:{text.count(chr(10), 0, span.start()) + 1}", code))
    return out


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with Grafana's ``$name`` / ``${name}`` / ``[[name]]`` replaced from ``values``.

    Raises:
        KeyError: a variable ``values`` does not name (the dashboard would not resolve it).
    """

    def one(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        if name not in values:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(one, expr)


def prometheus_binary() -> str:
    """The ``prometheus`` executable; a clear error when Debian's package is missing."""
    found = shutil.which("prometheus")
    if found is None:
        raise FileNotFoundError(
            "the `prometheus` binary is not installed: install Debian's `prometheus` package "
            "(apt-get install prometheus)"
        )
    return found


def scrape_config(targets: Mapping[str, str], token: str, interval: str = "1s") -> dict:
    """``deploy/prometheus.yml`` with its targets moved (``{"sidecar:8470": "127.0.0.1:P"}``),
    the admin token of this run as its credentials, and a short scrape interval."""
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    config["global"] = {**config.get("global", {}), "scrape_interval": interval}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [targets[t] for t in static["targets"]]
        if "authorization" in job:
            job["authorization"]["credentials"] = token
    return config


class Prometheus:
    """A real Prometheus on 127.0.0.1, its config and storage in ``folder``.

    Args:
        folder: where the config, the TSDB and the log go.
        config: the scrape config (``scrape_config``).
    """

    def __init__(self, folder: Path, config: dict) -> None:
        self.folder = folder
        self.config = config
        self.port = 0  # Prometheus logs the port 127.0.0.1:0 became; start() reads it
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> Prometheus:
        binary = prometheus_binary()
        config_file = self.folder / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(self.config))
        with open(self.folder / "prometheus.log", "wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config_file}"]
                + [f"--storage.tsdb.path={self.folder / 'tsdb'}"]
                + ["--web.listen-address=127.0.0.1:0"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait(self._read_port, timeout_s, "listening")
        self._wait(lambda: self._get("/-/ready") is not None, timeout_s, "ready")
        return self

    def wait_targets_up(self, timeout_s: float = 60) -> None:
        """Until every scrape target is up (a wrong token or path shows here)."""

        def all_up() -> bool:
            targets = self.api("/api/v1/targets")["activeTargets"]
            return bool(targets) and all(t["health"] == "up" for t in targets)

        self._wait(all_up, timeout_s, "scraping every target")

    def wait_scrapes_after(self, moment: float, timeout_s: float = 30) -> None:
        """Until every target was scraped twice after ``moment`` (``time.time()``)."""

        def scraped() -> bool:
            up = self.api("/api/v1/query", query="timestamp(up)")["result"]
            return bool(up) and all(float(s["value"][1]) > moment + 1.0 for s in up)

        self._wait(scraped, timeout_s, "scraping after the load")

    def api(self, path: str, **params: str) -> Any:
        body = self._get(f"{path}?{urllib.parse.urlencode(params)}" if params else path)
        if body is None:
            raise RuntimeError(f"Prometheus did not answer {path}: {self.log()}")
        answer = json.loads(body)
        if answer.get("status") != "success":
            raise RuntimeError(f"Prometheus refused {path} {params}: {answer}")
        return answer["data"]

    def label_values(self, selector: str | None, label: str) -> list[str]:
        params = {"match[]": selector} if selector else {}
        return self.api(f"/api/v1/label/{label}/values", **params)

    def stop(self) -> None:
        if self.proc is not None:
            end_process(self.proc, timeout_s=20)
            self.proc = None

    def _read_port(self) -> bool:
        """Whether its log says where it listens (``msg="Listening on" address=...``)."""
        found = _LISTENING.search(self.log_path.read_text(errors="replace"))
        if found:
            self.port = int(found[1])
        return found is not None

    @property
    def log_path(self) -> Path:
        return self.folder / "prometheus.log"

    def log(self) -> str:
        path = self.log_path
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            return exc.read()  # Prometheus says why in its JSON
        except OSError:
            return None

    def _wait(self, done: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log()}")
            try:
                if done():
                    return
            except (RuntimeError, KeyError, ValueError):
                pass
            time.sleep(0.25)
        targets = self._get("/api/v1/targets") or b""
        raise TimeoutError(f"Prometheus not {what} after {timeout_s} s: {targets[:2000]!r}")


def variable_values(prometheus: Prometheus, dashboard: Mapping[str, Any]) -> dict[str, str]:
    """Grafana's built-in intervals, and each query variable resolved the way Grafana would:
    its ``label_values`` asked of Prometheus, all its values as one regex alternation.

    Raises:
        ValueError: a variable whose query is not ``label_values`` or has no values.
    """
    values = dict(BUILTIN_VARIABLES)
    for name, query in dashboard_variables(dashboard).items():
        match = _LABEL_VALUES.match(query.strip())
        if match is None:
            raise ValueError(f"variable {name}: only label_values(...) is checked, got {query!r}")
        found = prometheus.label_values(match[1], match[2])
        if not found:
            raise ValueError(f"variable {name}: {query!r} has no values in Prometheus")
        values[name] = "|".join(re.escape(v) for v in found)
    return values


def evaluate(prometheus: Prometheus, query: Query, values: Mapping[str, str]) -> Answer:
    """Run ``query`` (its variables replaced from ``values``) as an instant query, now."""
    try:
        expr = substitute(query.expr, values)
    except KeyError as exc:
        return Answer(query, query.expr, 0, 0, str(exc))
    try:
        data = prometheus.api("/api/v1/query", query=expr)
    except RuntimeError as exc:
        return Answer(query, expr, 0, 0, str(exc))
    result = data["result"]
    if data["resultType"] == "scalar":
        result = [{"value": result}]
    samples = [float(s["value"][1]) for s in result]
    numbers = sum(1 for v in samples if v == v)  # NaN is the one float not equal to itself
    return Answer(query, expr, len(samples), numbers, values=tuple(samples))


def evaluate_all(
    prometheus: Prometheus, queries: Iterable[Query], values: Mapping[str, str]
) -> list[Answer]:
    """``evaluate`` each query."""
    return [evaluate(prometheus, q, values) for q in queries]
