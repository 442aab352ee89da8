"""The sidecar files a client's namespace under its tenant, within the one namespace limit."""

from __future__ import annotations

import pytest

from cachetier.server.auth import Scope
from cachetier.tiers.base import MAX_NAMESPACE_CHARS


def test_a_client_namespace_fits_under_its_tenant_or_is_refused() -> None:
    fits = "a" * (MAX_NAMESPACE_CHARS - len("t.alice."))
    assert Scope.of("alice", fits).storage == "t.alice." + fits
    with pytest.raises(ValueError, match="namespace"):
        Scope.of("alice", fits + "a")
    # The same name fits a shorter tenant: the limit is the stored name's, not the client's.
    assert Scope.of("bob", fits + "a").storage == "t.bob." + fits + "a"
