"""The remote tier: blocks kept by a cachetier server (``cachetier serve``), over HTTP.

from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
tier = RemoteTier(RemoteTierConfig(url="http://127.0.0.1:8470", token="..."))
"""

from cachetier.tiers.remote.config import RemoteTierConfig
from cachetier.tiers.remote.tier import RemoteTier

__all__ = ["RemoteTier", "RemoteTierConfig"]
