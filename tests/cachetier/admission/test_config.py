"""Admission settings: defaults, strict errors naming the setting, text from the environment,
and names that can join the store's flat namespace."""

from __future__ import annotations

import dataclasses

import pytest

from cachetier.admission import ADMISSION_POLICIES, DEFAULT_ADMISSION_POLICY, AdmissionConfig
from cachetier.store.config import StoreConfig
from cachetier.util.settings import build, env_values, flat_settings, parse_settings


def test_defaults() -> None:
    config = AdmissionConfig()
    assert config.admission_policy == DEFAULT_ADMISSION_POLICY in ADMISSION_POLICIES
    assert config.cheap_tiers == frozenset({"cpu"})
    assert config.admission_generated == "filter"


@pytest.mark.parametrize(
    "settings,error",
    [
        ({"admission_policy": "lru"}, "admission_policy must be one of"),
        ({"admission_policy": ""}, "admission_policy must be one of"),
        ({"admission_tracked_keys": 0}, "admission_tracked_keys must be a positive int"),
        ({"admission_tracked_keys": True}, "admission_tracked_keys must be a positive int"),
        ({"admission_tracked_keys": 2**40}, "admission_tracked_keys must be <="),
        ({"admission_threshold": 0}, "admission_threshold must be a positive int"),
        ({"admission_threshold": 17}, r"admission_threshold must be in \[1, 16\]"),
        ({"admission_cheap_tiers": "CPU"}, "not tier names"),
        ({"admission_cheap_tiers": "cpu;disk"}, "not tier names"),
        ({"admission_cheap_tiers": ["cpu"]}, "comma-separated tier names"),
        ({"admission_generated": "sometimes"}, "admission_generated must be one of"),
    ],
)
def test_bad_settings_are_refused_by_name(settings: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        AdmissionConfig(**settings)  # type: ignore[arg-type]


def test_settings_are_read_from_text_strictly() -> None:
    env = {
        "CACHETIER_ADMISSION_POLICY": "tinylfu",
        "CACHETIER_ADMISSION_TRACKED_KEYS": "2000",
        "CACHETIER_ADMISSION_THRESHOLD": "3",
    }
    config = build(AdmissionConfig, env_values(AdmissionConfig, env))
    assert (config.admission_policy, config.admission_tracked_keys) == ("tinylfu", 2000)
    assert config.admission_threshold == 3
    with pytest.raises(ValueError, match="CACHETIER_ADMISSION_TRACKED_KEYS='lots'"):
        env_values(AdmissionConfig, {"CACHETIER_ADMISSION_TRACKED_KEYS": "lots"})
    with pytest.raises(ValueError, match="'admission_polcy' -> 'admission_policy'"):
        parse_settings(AdmissionConfig, {"admission_polcy": "all"}, source="config file")


def test_every_setting_is_described_and_none_clashes_with_the_store() -> None:
    names = set(flat_settings(AdmissionConfig))
    assert all(name.startswith("admission_") for name in names)
    store_own = {f.name for f in dataclasses.fields(StoreConfig)}  # what it declares itself
    assert not names & store_own
    assert names <= set(flat_settings(StoreConfig))  # held by the store, by the same names
