"""Settings declared once (``cachetier.util.settings``): the flat namespace a config and the
configs it holds make, strict parsing with errors that name the key, and the store's settings
held, never declared again, by the sidecar's and the plugins' configs."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from cachetier.connectors.config import ConnectorConfig
from cachetier.server.config import ServerConfig
from cachetier.store.config import StoreConfig
from cachetier.util.settings import (
    add_flags,
    build,
    check_keys,
    env_values,
    flag_values,
    flat_settings,
    nested,
    parse_settings,
    setting,
)

HOLDERS = (ServerConfig, ConnectorConfig)


@dataclass(frozen=True, slots=True)
class Inner:
    """A held config."""

    size: int = setting(3, "a size.")
    ratio: float | None = setting(None, "a ratio.")
    on: bool = setting(True, "a switch.")
    token: str | None = setting(None, "a secret.", secret=True)


@dataclass(frozen=True, slots=True)
class Outer:
    """A config holding ``Inner``."""

    name: str = setting("x", "a name.")
    inner: Inner = nested(Inner, "the inner settings.")


def test_the_store_is_held_not_declared_again() -> None:
    store_fields = {f.name for f in dataclasses.fields(StoreConfig)}
    for holder in HOLDERS:
        own = {f.name: f for f in dataclasses.fields(holder)}
        assert not store_fields & set(own), f"{holder.__name__} re-declares store settings"
        assert own["store"].type == "StoreConfig"
        # ... and its flat namespace still takes every store setting by its own name.
        table = flat_settings(holder)
        store_settings = flat_settings(StoreConfig)  # its own and its nested configs' settings
        assert set(store_settings) <= set(table)
        assert all(
            table[name].owner is setting.owner and table[name].path == ("store", *setting.path)
            for name, setting in store_settings.items()
        )


@pytest.mark.parametrize("cls", [StoreConfig, *HOLDERS])
def test_every_setting_has_a_description(cls: type) -> None:
    for name, item in flat_settings(cls).items():
        assert item.description.strip(), name
        assert item.description.rstrip().endswith((".", ")")), f"{name}: a whole sentence"


def test_our_engine_and_the_plugins_share_their_common_settings() -> None:
    from cachetier.engine.config import EngineConfig

    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    plugin = {f.name: f for f in dataclasses.fields(ConnectorConfig)}
    common = set(engine) & set(plugin)
    assert common == {
        "tenant",
        "kv_load_policy",
        "record_tokens",
        "guard",
        "guard_first_hits",
        "guard_fraction",
        "record_check",
        "record_check_tokens",
    }
    for name in common:
        assert engine[name].metadata == plugin[name].metadata, name
        assert engine[name].default == plugin[name].default, name


def test_nested_settings_join_the_holders_namespace() -> None:
    assert list(flat_settings(Outer)) == ["name", "size", "ratio", "on", "token"]
    config = build(Outer, parse_settings(Outer, {"size": "7", "name": "y"}, source="test"))
    assert config == Outer(name="y", inner=Inner(size=7))


def test_a_name_declared_twice_is_refused() -> None:
    @dataclass(frozen=True)
    class Clash:
        size: int = setting(1, "another size.")
        inner: Inner = nested(Inner, "the inner settings.")

    with pytest.raises(TypeError, match="'size' is declared by both Clash and Inner"):
        flat_settings(Clash)


def test_a_name_clash_fails_the_import_of_its_module(tmp_path, monkeypatch) -> None:
    # The config modules compute their namespace at import (ServerConfig's SETTINGS...).
    (tmp_path / "clashing_config.py").write_text(
        "from dataclasses import dataclass\n"
        "from cachetier.store.config import StoreConfig\n"
        "from cachetier.util.settings import flat_settings, nested, setting\n"
        "@dataclass(frozen=True)\n"
        "class Bad:\n"
        "    cpu_bytes: int = setting(1, 'a second cpu_bytes.')\n"
        "    store: StoreConfig = nested(StoreConfig, 'the tiers.')\n"
        "SETTINGS = flat_settings(Bad)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match="'cpu_bytes' is declared by both Bad and StoreConfig"):
        __import__("clashing_config")


def test_a_setting_without_a_description_is_refused() -> None:
    with pytest.raises(TypeError, match="description"):
        setting(1, " ")

    @dataclass
    class Bare:
        size: int = 1

    with pytest.raises(TypeError, match="Bare.size has no description"):
        flat_settings(Bare)


@pytest.mark.parametrize(
    "text,value",
    [(w, True) for w in ("true", "TRUE", "1", "yes", "On")]
    + [(w, False) for w in ("false", "False", "0", "no", "OFF")],
)
def test_booleans_take_their_words_in_any_case(text: str, value: bool) -> None:
    assert parse_settings(Inner, {"on": text}, source="test") == {"on": value}


@pytest.mark.parametrize(
    "values,message",
    [
        ({"on": "ture"}, "test: on='ture' is not a boolean"),
        ({"on": ""}, "test: on='' is not a boolean"),
        ({"on": 2}, "test: on=2 is not a boolean"),
        ({"size": "12x"}, "test: size='12x' is not an integer"),
        ({"size": 1.5}, "test: size=1.5 is not an integer"),
        ({"size": True}, "test: size=True is not an integer"),
        ({"size": None}, "test: size needs a value"),
        ({"ratio": "half"}, "test: ratio='half' is not a number"),
        ({"name": 5}, "test: name=5 is not a string"),
    ],
)
def test_a_value_that_does_not_parse_is_an_error_naming_its_key(values: dict, message: str) -> None:
    cls = Outer if "name" in values else Inner
    with pytest.raises(ValueError) as refused:
        parse_settings(cls, values, source="test")
    assert str(refused.value).startswith(message)


def test_a_secrets_value_is_never_in_an_error() -> None:
    @dataclass
    class Held:
        tokens: dict = setting(default_factory=dict, description="tokens.", secret=True)

    with pytest.raises(ValueError) as refused:
        parse_settings(Held, {"tokens": "s3cret-token-0123456789"}, source="test")
    assert "s3cret" not in str(refused.value) and "tokens=***" in str(refused.value)


def test_optional_settings_take_none_words_and_parsing_twice_changes_nothing() -> None:
    for word in ("", "none", "NULL"):
        assert parse_settings(Inner, {"ratio": word}, source="t") == {"ratio": None}
    once = parse_settings(Inner, {"size": "4", "ratio": "0.5", "on": "no"}, source="t")
    assert once == {"size": 4, "ratio": 0.5, "on": False}
    assert parse_settings(Inner, once, source="t") == once
    assert parse_settings(Inner, {"size": 4.0}, source="t") == {"size": 4}


def test_an_unknown_key_is_an_error_naming_it_and_the_accepted_ones() -> None:
    with pytest.raises(ValueError) as refused:
        parse_settings(Outer, {"sise": 3, "name": "y"}, source="my file")
    message = str(refused.value)
    assert message.startswith("unknown my file keys ['sise'] (did you mean 'sise' -> 'size'?)")
    assert message.endswith(f"accepted: {sorted(flat_settings(Outer))}")
    check_keys({"size"}, {"size"}, source="x")  # nothing unknown: no error


def test_the_environment_is_read_by_setting_name_and_spelt_in_errors() -> None:
    env = {"CACHETIER_SIZE": "9", "CACHETIER_ON": "off", "CACHETIER_HOME": "/elsewhere"}
    assert env_values(Outer, env) == {"size": 9, "on": False}
    with pytest.raises(ValueError, match=r"^environment: CACHETIER_ON='ture' is not a boolean"):
        env_values(Outer, {"CACHETIER_ON": "ture"})


def test_flags_come_from_the_settings_but_the_secrets() -> None:
    parser = argparse.ArgumentParser()
    assert add_flags(parser, Outer) == ["name", "size", "ratio", "on"]
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["size"] == "a size. (default 3)"
    args = parser.parse_args(["--size", "5", "--no-on"])
    assert flag_values(Outer, args) == {"size": 5, "on": False}
    with pytest.raises(ValueError, match=r"^command line: --size='five' is not an integer"):
        flag_values(Outer, parser.parse_args(["--size", "five"]))


def test_every_store_setting_has_a_serve_flag_with_its_description() -> None:
    from cachetier.cli.main import build_parser

    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    serve = subparsers.choices["serve"]
    by_dest = {a.dest: a for a in serve._actions}
    for name, item in flat_settings(StoreConfig).items():
        if item.secret:
            assert name not in by_dest, f"{name} is a secret: no flag"
            continue
        assert item.flag in by_dest[name].option_strings
        assert by_dest[name].help.startswith(item.description.replace("``", "")[:40])
