"""What the connector's scheduler side knows of one request (``Tracked``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cachetier.connectors.vllm.metadata import BlockTransfer
from cachetier.primitives.keys import BlockHash, Namespace
from cachetier.store.costmodel import LoadPlan

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(slots=True)
class Tracked:
    """What the scheduler side knows of one request: per KV cache group (``kv_groups``) its
    namespace, the keys of its first full records and its vLLM block ids in token order; the
    first group's as ``namespace``, ``keys`` and ``block_ids``."""

    request: Request
    namespaces: list[Namespace]
    group_keys: list[list[BlockHash]] = field(default_factory=list)
    group_block_ids: list[list[int]] = field(default_factory=list)
    num_stored_blocks: int = 0  # leading blocks known stored (hit, loaded or saved)
    hit: tuple[int, int, dict[str, int]] = (0, 0, {})  # first block, num blocks, tokens by tier
    hit_async: bool = False  # the hit is loaded beside the forwards
    # First block the worker failed to load or store: no hit reaches past it again. vLLM asks
    # again after an async load that failed (the request starts over from its local hit), and
    # a tier that times out on these blocks would be asked for them for ever.
    failed_from: int | None = None
    pending_loads: list[BlockTransfer] = field(default_factory=list)
    # A plan that recomputed stored blocks, and the forward seconds of the steps that computed
    # the prompt since: the cost model learns its error from them once the prompt is done.
    refused_plan: LoadPlan | None = None
    refused_compute_s: float = 0.0
    prompt_scheduled: bool = False  # the step computing its last prompt token is planned
    num_known_stored: int = 0  # leading blocks a shared tier was seen to hold
    # A hit the guard drew: each hit record's key and the tier that held it, until vLLM's
    # computed block of that key is saved and compared (``cachetier.connectors.vllm.guard``).
    verify: dict[BlockHash, str] = field(default_factory=dict)
    # Whether the guard has drawn for this request's hit: vLLM asks a waiting request's match
    # again at every step it stays queued, and a draw at each ask would verify far more than
    # ``guard_fraction`` of requests.
    guard_drawn: bool = False

    def __post_init__(self) -> None:
        self.group_keys = [[] for _ in self.namespaces]
        self.group_block_ids = [[] for _ in self.namespaces]

    @property
    def namespace(self) -> Namespace:
        return self.namespaces[0]

    @property
    def keys(self) -> list[BlockHash]:
        return self.group_keys[0]

    @property
    def block_ids(self) -> list[int]:
        return self.group_block_ids[0]
