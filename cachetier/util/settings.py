"""Settings declared once, read from every surface by one parser.

A config dataclass declares each of its fields with ``setting(default, "what it is")``: the
field's name, default and description live there and nowhere else. A field that holds another
config (``ServerConfig.store``, ``ConnectorConfig.store``) is declared with
``nested(StoreConfig, "...")``: the held class's settings join the holder's one flat namespace
under their own names, so ``redis_url`` is spelt the same in a TOML file, as
``CACHETIER_REDIS_URL``, as ``--redis-url`` and in an engine's extra config, for the sidecar, a
plugin and the store alike. ``flat_settings`` refuses two settings of one name, so a config
module that computes its namespace at import cannot be imported with a clash.

Values are parsed strictly, and every error names the key as its surface spells it: a boolean
is ``true``/``false``, ``1``/``0``, ``yes``/``no`` or ``on``/``off`` (any case), a number must
parse, an optional setting takes ``""``, ``none`` or ``null`` as ``None``, and an unknown key
is refused with the accepted ones listed.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

ENV_PREFIX = "CACHETIER_"
_HELP = "help"
_PARSE = "parse"
_NESTED = "nested"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NONE = frozenset({"", "none", "null"})
_SCALARS = (bool, int, float, str)


def setting(
    default: Any = MISSING,
    description: str = "",
    *,
    default_factory: Callable[[], Any] | Any = MISSING,
    secret: bool = False,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A dataclass field that carries its one description.

    Args:
        default: the default value.
        description: what the setting does, for ``--help``, the docs and errors.
        default_factory: instead of ``default``, a function that makes it.
        secret: a token or password: left out of reprs, and given no command-line flag (the
            process list would show it).
        parse: how to read the setting from text (an environment variable, a flag), for a
            type other than ``bool``, ``int``, ``float`` and ``str`` or one written otherwise
            (permission bits in octal).

    Returns:
        The ``dataclasses.field``.
    """
    if not description.strip():
        raise TypeError("a setting needs its description")
    metadata: dict[str, Any] = {_HELP: description}
    if parse is not None:
        metadata[_PARSE] = parse
    return field(
        default=default, default_factory=default_factory, repr=not secret, metadata=metadata
    )


def nested(cls: type, description: str) -> Any:
    """A dataclass field holding a ``cls`` whose settings join the holder's namespace.

    Args:
        cls: a config dataclass whose fields are ``setting``s; its defaults are the default.
        description: what the held config is, for the docs.

    Returns:
        The ``dataclasses.field``.
    """
    return field(default_factory=cls, metadata={_HELP: description, _NESTED: True})


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting of a config's flat namespace.

    Args:
        name: its one name (the field's).
        path: the nested fields that hold it, outermost first (``()``: the config's own).
        owner: the dataclass that declares it.
        kind: its type, resolved.
        field: its ``dataclasses.Field`` (default, default factory, ``repr``).
    """

    name: str
    path: tuple[str, ...]
    owner: type
    kind: Any
    field: dataclasses.Field

    @property
    def description(self) -> str:
        """What the setting does."""
        return self.field.metadata[_HELP]

    @property
    def env(self) -> str:
        """Its environment variable, ``CACHETIER_<NAME>``."""
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        """Its command-line flag, ``--name-with-dashes``."""
        return "--" + self.name.replace("_", "-")

    @property
    def secret(self) -> bool:
        """Whether it is kept out of reprs (and so off the command line)."""
        return not self.field.repr


def flat_settings(cls: type) -> dict[str, Setting]:
    """Every setting of ``cls`` by name: its own fields and those of the configs it nests.

    Args:
        cls: a config dataclass declared with ``setting`` and ``nested``.

    Returns:
        name -> ``Setting``, in declaration order (nested ones where their holder is).

    Raises:
        TypeError: a field without a description, or two settings of one name.
    """
    hints = typing.get_type_hints(cls)
    out: dict[str, Setting] = {}
    for f in fields(cls):
        if _HELP not in f.metadata:
            raise TypeError(
                f"{cls.__name__}.{f.name} has no description: declare it with setting()"
            )
        if f.metadata.get(_NESTED):
            inner = flat_settings(hints[f.name]).values()
            found = [dataclasses.replace(s, path=(f.name, *s.path)) for s in inner]
        else:
            found = [Setting(f.name, (), cls, hints[f.name], f)]
        for item in found:
            if item.name in out:
                raise TypeError(
                    f"setting {item.name!r} is declared by both {out[item.name].owner.__name__} "
                    f"and {item.owner.__name__} in {cls.__name__}: one name, one setting"
                )
            out[item.name] = item
    return out


def check_keys(given: Collection[str], accepted: Collection[str], *, source: str) -> None:
    """Refuse keys not in ``accepted``, naming the closest accepted one.

    Args:
        given: the keys the user gave.
        accepted: the keys accepted where they were given.
        source: where they were given, for the message.

    Raises:
        ValueError: a key not accepted; the message lists only the accepted keys.
    """
    unknown = sorted(set(given) - set(accepted))
    if not unknown:
        return
    hints = [
        f"{key!r} -> {close[0]!r}"
        for key in unknown
        if (close := difflib.get_close_matches(key, sorted(accepted), n=1))
    ]
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    raise ValueError(f"unknown {source} keys {unknown}{hint}; accepted: {sorted(accepted)}")


def parse_settings(
    cls: type,
    values: Mapping[str, Any],
    *,
    source: str,
    spell: Callable[[str], str] | None = None,
) -> dict[str, Any]:
    """Check and parse values given by setting name (text or Python values).

    Args:
        cls: the config whose flat namespace the names are in.
        values: name -> value, as a surface gives them (text from the environment or a flag,
            typed values from a file or an engine's config).
        source: where they were given, for errors.
        spell: how that surface spells a name, for errors (default: the name itself).

    Returns:
        name -> parsed value (parsing a parsed value again changes nothing).

    Raises:
        ValueError: an unknown name, or a value its setting cannot take.
    """
    table = flat_settings(cls)
    check_keys(values, table, source=source)
    spell = spell or (lambda name: name)
    return {
        name: parse_value(table[name], value, key=f"{source}: {spell(name)}")
        for name, value in values.items()
    }


def parse_value(item: Setting, value: Any, *, key: str) -> Any:
    """One setting's value, parsed and checked against its type.

    Args:
        item: the setting.
        value: text, or a Python value.
        key: the key as its surface spells it, for errors.

    Returns:
        The value.

    Raises:
        ValueError: a value the setting cannot take.
    """
    optional, base = _unwrap_optional(item.kind)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{key} needs a value, not None")
    # A secret's value never goes into a message (it may be printed or logged).
    shown = f"{key}=***" if item.secret else f"{key}={value!r}"
    if isinstance(value, str):
        if optional and value.strip().lower() in _NONE:
            return None
        parse = item.field.metadata.get(_PARSE)
        if parse is not None:
            try:
                return parse(value)
            except ValueError as exc:
                raise ValueError(f"{shown}: {exc}") from None
        return _from_text(base, value, shown)
    return _checked(base, value, shown)


def _unwrap_optional(kind: Any) -> tuple[bool, Any]:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return len(args) < len(typing.get_args(kind)), args[0]
    return False, kind


def _from_text(base: Any, text: str, shown: str) -> Any:
    if base is bool:
        word = text.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError(f"{shown} is not a boolean: use true or false (1/0, yes/no, on/off)")
    if base is int:
        try:
            return int(text.strip())
        except ValueError:
            raise ValueError(f"{shown} is not an integer") from None
    if base is float:
        try:
            return float(text.strip())
        except ValueError:
            raise ValueError(f"{shown} is not a number") from None
    if base is str:
        return text
    raise ValueError(f"{shown}: this setting is not given as text")


def _checked(base: Any, value: Any, shown: str) -> Any:
    if base is bool:
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        raise ValueError(f"{shown} is not a boolean: use true or false")
    if base is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{shown} is not an integer")
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{shown} is not a number")
        return float(value)
    if base is str:
        raise ValueError(f"{shown} is not a string")
    return value  # a table or a list: the config's __post_init__ checks it


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """A ``cls`` from parsed values of its flat namespace (nested configs built first).

    Args:
        cls: the config dataclass.
        values: name -> value (``parse_settings``); the rest keep their defaults.

    Returns:
        The config (its ``__post_init__`` checks the values together).
    """
    table = flat_settings(cls)
    own: dict[str, Any] = {}
    held: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        path = table[name].path
        if path:
            held.setdefault(path[0], {})[name] = value
        else:
            own[name] = value
    hints = typing.get_type_hints(cls)
    for holder, inner in held.items():
        own[holder] = build(hints[holder], inner)
    return cls(**own)


def env_values(cls: type, env: Mapping[str, str]) -> dict[str, Any]:
    """The settings of ``cls`` that ``env`` gives as ``CACHETIER_<NAME>``, parsed.

    Other ``CACHETIER_*`` variables are left alone (``CACHETIER_HOME``, a test's own).

    Args:
        cls: the config dataclass.
        env: the environment to read.

    Returns:
        name -> parsed value, for the settings ``env`` sets.
    """
    table = flat_settings(cls)
    given = {name: env[item.env] for name, item in table.items() if item.env in env}
    return parse_settings(cls, given, source="environment", spell=lambda n: table[n].env)


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    aliases: Mapping[str, Collection[str]] | None = None,
) -> list[str]:
    """A ``--name-with-dashes`` flag for every setting of ``cls`` but the secrets.

    Each flag's help is the setting's description; its value is text, parsed later by
    ``parse_settings`` (booleans are ``--x`` / ``--no-x``). Unset flags are ``None``.

    Args:
        parser: where to add them.
        cls: the config dataclass.
        aliases: setting name -> more option strings for its flag.

    Returns:
        The names of the settings given a flag (each one's ``dest``).
    """
    names = []
    for name, item in flat_settings(cls).items():
        if item.secret:
            continue
        options = [item.flag, *(aliases or {}).get(name, ())]
        text = item.description.replace("``", "").replace("%", "%%")
        default = default_text(item)
        if default is not None:
            text = f"{text} (default {default.replace('%', '%%')})"
        optional, base = _unwrap_optional(item.kind)
        if base is bool and not optional:
            parser.add_argument(
                *options, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        else:
            metavar = base.__name__.upper() if base in _SCALARS else "TEXT"
            parser.add_argument(*options, dest=name, default=None, metavar=metavar, help=text)
        names.append(name)
    return names


def flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The settings given by the flags of ``add_flags``, parsed.

    Args:
        cls: the config dataclass the flags were made for.
        args: the parsed command line.

    Returns:
        name -> value, for the flags given; an error names the flag as typed.

    Raises:
        ValueError: a value its setting cannot take.
    """
    table = flat_settings(cls)
    given = {name: getattr(args, name, None) for name in table}
    flags = {name: value for name, value in given.items() if value is not None}
    return parse_settings(cls, flags, source="command line", spell=lambda n: table[n].flag)


def default_text(item: Setting) -> str | None:
    """A setting's default as text; ``None`` for one required or made by a factory."""
    value = item.field.default
    if value is MISSING:  # required, or made by a factory (computed at start, or empty)
        return None
    if isinstance(value, int) and not isinstance(value, bool) and item.name.endswith("_mode"):
        return f"0o{value:o}"
    return repr(value)
