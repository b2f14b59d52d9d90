"""deploy/prometheus/alerts.yaml under Prometheus' own `promtool` (Debian's `prometheus`
package): `promtool check rules`, and `promtool test rules` on the unit tests in
tests/prometheus/alerts_test.yaml, which must hold a firing and a quiet case for every
alert in the rule file.

Skipped, saying why, where promtool is not installed; under CI (CI=true) a missing
promtool fails instead (`.ci/run` installs the package). The live counterpart, every
rule and dashboard query against a real worker's metrics, is
tests/integration/test_prometheus_live.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.prometheus_fixtures import require_binary

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
ALERT_TESTS = ROOT / "tests" / "prometheus" / "alerts_test.yaml"


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_binary("promtool")


def _promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def _alert_names() -> list[str]:
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _alert_tests() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERT_TESTS.read_text(encoding="utf-8"))
    return [case for test in doc["tests"] for case in test.get("alert_rule_test", [])]


def test_promtool_check_rules(promtool: str) -> None:
    proc = _promtool(promtool, "check", "rules", str(ALERTS.relative_to(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_alert_names())} rules found" in proc.stdout, proc.stdout


def test_promtool_unit_tests_pass(promtool: str) -> None:
    proc = _promtool(promtool, "test", "rules", str(ALERT_TESTS.relative_to(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout, proc.stdout


def test_the_unit_tests_load_the_deployed_rule_file() -> None:
    doc = yaml.safe_load(ALERT_TESTS.read_text(encoding="utf-8"))
    files = [(ALERT_TESTS.parent / f).resolve() for f in doc["rule_files"]]
    assert files == [ALERTS.resolve()]


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    """A new alert in alerts.yaml without unit tests fails here."""
    firing: dict[str, int] = {}
    quiet: dict[str, int] = {}
    for case in _alert_tests():
        name = case["alertname"]
        expected = case.get("exp_alerts") or []
        target = firing if expected else quiet
        target[name] = target.get(name, 0) + 1
        for alert in expected:
            # the labels and annotations are asserted, not just "some alert fired"
            assert alert.get("exp_labels", {}).get("severity"), (name, alert)
            annotations = alert.get("exp_annotations", {})
            assert annotations.get("summary") and annotations.get("description"), (name, alert)
    names = set(_alert_names())
    assert names, "no alerts found in alerts.yaml"
    assert not names - firing.keys(), f"alerts with no firing case: {sorted(names - firing.keys())}"
    assert not names - quiet.keys(), f"alerts with no quiet case: {sorted(names - quiet.keys())}"
    unknown = (firing.keys() | quiet.keys()) - names
    assert not unknown, f"tests for alerts that do not exist: {sorted(unknown)}"
