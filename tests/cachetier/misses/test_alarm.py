"""The namespace-mismatch alarm: one warning naming what differs once a pair's share of recent
misses passes the threshold, none below it or before enough lookups, and a recent upgrade
noticed after a long healthy past."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from cachetier.misses import MismatchAlarm, NamespaceDescriptor

ASKED = NamespaceDescriptor("model-v2", "bfloat16", 16, "kv_layer_major", 2, tenant="acme")
HELD = dataclasses.replace(ASKED, model_fingerprint="model-v1", dtype="float16")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cachetier.misses"]


def test_it_warns_once_past_the_threshold_naming_what_differs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="cachetier.misses")
    alarm = MismatchAlarm(threshold=0.5, min_lookups=4)
    fired = [alarm.observe(10, 8, ASKED, HELD) for _ in range(20)]
    assert fired == [False] * 3 + [True] + [False] * 16  # only once min_lookups are seen
    (message,) = _warnings(caplog)
    assert "80% of recently missed blocks" in message
    assert "model fingerprint 'model-v2' asked, 'model-v1' held" in message
    assert "dtype 'bfloat16' asked, 'float16' held" in message
    assert alarm.warned == {(ASKED, HELD)}


def test_it_stays_quiet_at_or_below_the_threshold(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cachetier.misses")
    alarm = MismatchAlarm(threshold=0.5, min_lookups=4)
    for _ in range(200):
        assert not alarm.observe(10, 4, ASKED, HELD)
        assert not alarm.observe(10, 6, ASKED, HELD)  # 50% over the pair of lookups
        assert not alarm.observe(7, 0)
    assert _warnings(caplog) == [] and alarm.warned == frozenset()


def test_each_pair_warns_on_its_own_share(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cachetier.misses")
    alarm = MismatchAlarm(threshold=0.3, min_lookups=2)
    tenant = dataclasses.replace(ASKED, tenant="globex")
    for _ in range(10):
        alarm.observe(10, 5, ASKED, HELD)
        alarm.observe(10, 1, ASKED, tenant)  # 10% of the misses: below
    assert alarm.warned == {(ASKED, HELD)}
    for _ in range(10):
        alarm.observe(10, 10, ASKED, tenant)
    assert alarm.warned == {(ASKED, HELD), (ASKED, tenant)}
    tenant_message = _warnings(caplog)[1]
    assert "tenant 'acme' asked, 'globex' held" in tenant_message
    assert "Only the tenant differs" in tenant_message
    assert "Only the tenant differs" not in _warnings(caplog)[0]


def test_an_upgrade_after_a_long_healthy_past_is_noticed_soon() -> None:
    alarm = MismatchAlarm(threshold=0.5, min_lookups=50)
    for _ in range(10_000):
        alarm.observe(10, 0)
    fired_after = next(i for i in range(1, 1000) if alarm.observe(10, 10, ASKED, HELD))
    assert fired_after <= 150  # counts halve every 50 lookups: a few windows, not 10,000


@pytest.mark.parametrize(
    "threshold,min_lookups,message",
    [
        (1.0, 10, "threshold must be a number in"),
        (-0.1, 10, "threshold must be a number in"),
        ("half", 10, "threshold must be a number in"),
        (0.5, 0, "min_lookups must be a positive int"),
    ],
)
def test_bad_settings_are_refused(threshold: object, min_lookups: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MismatchAlarm(threshold, min_lookups)  # type: ignore[arg-type]


def test_bad_observations_are_refused() -> None:
    alarm = MismatchAlarm(0.5, 1)
    with pytest.raises(ValueError, match="cannot exceed num_missed"):
        alarm.observe(3, 4, ASKED, HELD)
    with pytest.raises(ValueError, match="num_missed must be an int >= 0"):
        alarm.observe(-1, 0)
    with pytest.raises(TypeError, match="needs asked and held descriptors"):
        alarm.observe(3, 2)
