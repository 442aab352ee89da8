"""Secrets out of everything cachetier prints: URL passwords, bearer tokens, known secrets.

Config reprs, error messages, the ``cachetier serve`` config echo and log lines all go through
the functions here, so there is one way for a secret to be masked and one place to fix it.

- ``redact_url``: a URL with the password of its userinfo (and secret query values) masked.
- ``redact``: free text (an exception message, a log line) with every URL in it redacted,
  ``Bearer <token>`` masked, and any of the given known secrets masked.
- ``redacted_repr``: a config dataclass's repr with its URL fields redacted (fields declared
  ``repr=False``, such as tokens, are left out).
- ``install_log_redaction``: a logging filter that runs ``redact`` over every record that
  reaches the given loggers' handlers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import Any
from urllib.parse import quote, unquote, urlsplit

MASK = "***"
# Known secrets shorter than this are masked inside URLs only: replacing a 2-character password
# everywhere in a log line would mangle the line and hide nothing worth hiding.
MIN_SECRET_CHARS = 4
# Query parameters whose value is a secret (redis-py reads ``?password=`` as the password).
_SECRET_QUERY_RE = re.compile(
    r"([?&;][^=&#;]*(?:pass|secret|token|auth|key|credential)[^=&#;]*=)[^&#;]*", re.IGNORECASE
)
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
# A bearer token after its scheme name (RFC 6750 b64token). At least 12 characters, so that
# prose ("the bearer token is ...") is left alone; shorter known tokens are masked by value.
_BEARER_RE = re.compile(r"(Bearer\s+)[A-Za-z0-9._~+/-]{12,}=*", re.IGNORECASE)
_MASK_VALUE = r"\g<1>" + MASK  # a substitution keeping group 1 (the name) and masking the rest


def redact_url(url: str) -> str:
    """``url`` with its password (and secret query values) replaced by ``***``.

    ``redis://user:pw@host/0`` becomes ``redis://user:***@host/0``; userinfo without a
    colon (``https://TOKEN@host``, which some services take as a token) is masked whole. The
    userinfo is taken to end at the last ``@``, so a password holding ``/``, ``?`` or ``#``
    unescaped is still masked in full (at worst, more than the userinfo is).

    Args:
        url: any URL, or a string that is not one (returned unchanged).

    Returns:
        The URL, safe to print.
    """
    if not isinstance(url, str):
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, after = rest.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        rest = f"{user}:{MASK}@{after}" if colon else f"{MASK}@{after}"
    return f"{scheme}://{_SECRET_QUERY_RE.sub(_MASK_VALUE, rest)}"


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with every URL in it redacted, bearer tokens masked, and ``secrets`` masked.

    Args:
        text: a message, a log line, a repr.
        secrets: known secrets (tokens, passwords) to mask wherever they appear, also in
            their percent-encoded form; ``None`` and ones shorter than ``MIN_SECRET_CHARS``
            are skipped.

    Returns:
        The text, safe to print.
    """
    if not isinstance(text, str):
        text = str(text)
    for secret in _longest_first(secrets):
        for form in {secret, quote(secret, safe="")}:
            text = text.replace(form, MASK)
    text = _URL_RE.sub(lambda m: redact_url(m.group(0)), text)
    return _BEARER_RE.sub(_MASK_VALUE, text)


def url_secrets(url: str | None) -> list[str]:
    """The secrets a URL carries: its password (or whole userinfo when it has no colon) and
    secret query values, decoded. For ``redact``'s ``secrets``.

    Args:
        url: a URL, or ``None``.

    Returns:
        The secrets found (possibly none).
    """
    if not url or "://" not in url:
        return []
    rest = url.partition("://")[2]
    userinfo, at, _ = rest.rpartition("@")
    out: list[str] = []
    if at:
        user, colon, password = userinfo.partition(":")
        out.append(unquote(password) if colon else unquote(user))
    query = urlsplit(url).query
    for match in _SECRET_QUERY_RE.finditer(f"?{query}" if query else ""):
        out.append(unquote(match.group(0)[len(match.group(1)) :]))
    return [s for s in out if s]


def redacted_repr(obj: Any) -> str:
    """The repr of a dataclass instance with every string field that holds a URL redacted.

    Fields declared ``field(repr=False)`` are left out, as in the dataclass's own repr. Config
    classes define ``__repr__`` as this, so ``repr(config)`` and ``f"{config}"`` never show a
    password.

    Args:
        obj: a dataclass instance.

    Returns:
        ``ClassName(field=value, ...)``.
    """
    parts = []
    for f in fields(obj):
        if not f.repr:
            continue
        value = getattr(obj, f.name)
        if isinstance(value, str) and "://" in value:
            value = redact_url(value)
        parts.append(f"{f.name}={value!r}")
    return f"{type(obj).__qualname__}({', '.join(parts)})"


class RedactingFilter(logging.Filter):
    """Runs ``redact`` over a record's message, its arguments and its traceback.

    String arguments are redacted one by one, so formatters that unpack ``record.args``
    (uvicorn's access log) keep working; an argument of another type whose text carries a
    secret (an exception's repr) makes the record's message pre-formatted and redacted.

    Args:
        secrets: known secrets to mask besides URL passwords and bearer tokens.
    """

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        super().__init__()
        self._secrets = tuple(_longest_first(secrets))

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg, self._secrets)
        if isinstance(record.args, tuple):
            record.args = tuple(
                redact(a, self._secrets) if isinstance(a, str) else a for a in record.args
            )
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            message = None  # a bad format string: logging reports it itself
        if message is not None:
            safe = redact(message, self._secrets)
            if safe != message:
                record.msg, record.args = safe, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, self._secrets)
        if record.stack_info:
            record.stack_info = redact(record.stack_info, self._secrets)
        return True


def install_log_redaction(
    secrets: Iterable[str | None] = (),
    loggers: Sequence[str] = ("", "uvicorn", "uvicorn.error", "uvicorn.access"),
) -> RedactingFilter:
    """Add a ``RedactingFilter`` to every handler of ``loggers`` (a filter on a handler sees
    the records propagated from child loggers too; one on a logger would not).

    Call it after logging is configured (``logging.basicConfig``, ``uvicorn.Config``).

    Args:
        secrets: known secrets to mask (tokens, passwords).
        loggers: names of the loggers whose handlers get the filter (``""``: the root).

    Returns:
        The filter.
    """
    redactor = RedactingFilter(secrets)
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(redactor)
    return redactor


def _longest_first(secrets: Iterable[str | None]) -> list[str]:
    # Longest first: a secret that contains another is masked whole, not in pieces.
    found = {s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET_CHARS}
    return sorted(found, key=len, reverse=True)
