"""The traces ``benchmarks.admission`` replays: the shipped conversation trace, and a RAG trace
it makes.

The RAG trace (``RagShape``) is the other reuse shape a prefix cache serves: every request is
a shared system prompt, one document of a corpus retrieved by a skewed popularity, and a
one-off question. A block's reuse is decided by its document: the system prompt is in every
request, a popular document's blocks in many, a tail document's once or twice, the question's
never. Requests are Mooncake-format ``TraceRequest``s with chained hash ids, so they key and
replay as the shipped trace does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cachetier.report.replay import BLOCK_SIZE, TraceRequest, read_trace
from cachetier.util.checks import positive_int

CONVERSATION_TRACE = (
    Path(__file__).resolve().parents[2] / "workloads" / "mooncake_conversation_trace.jsonl.gz"
)


@dataclass(frozen=True, slots=True)
class RagShape:
    """Parameters of the RAG trace (blocks are ``BLOCK_SIZE`` tokens).

    Args:
        num_requests: requests of the trace.
        num_documents: documents of the corpus.
        min_document_blocks: shortest document, in blocks.
        max_document_blocks: longest document, in blocks (lengths uniform in between).
        zipf_exponent: a document's popularity falls as ``rank ** -zipf_exponent`` (the ranks
            shuffled over the corpus).
        system_blocks: blocks of the system prompt every request starts with.
        max_question_blocks: a request ends with 1 to this many blocks of its own (the last
            one partial).
        mean_gap_ms: mean time between arrivals (Poisson).
        seed: seed of the generator.
    """

    num_requests: int = 6000
    num_documents: int = 5000
    min_document_blocks: int = 8
    max_document_blocks: int = 40
    zipf_exponent: float = 0.8
    system_blocks: int = 4
    max_question_blocks: int = 3
    mean_gap_ms: float = 500.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "num_documents", "min_document_blocks", "system_blocks"):
            positive_int(name, getattr(self, name))
        positive_int("max_question_blocks", self.max_question_blocks)
        if self.max_document_blocks < self.min_document_blocks:
            raise ValueError(
                f"max_document_blocks ({self.max_document_blocks}) must be >= "
                f"min_document_blocks ({self.min_document_blocks})"
            )
        if not (self.zipf_exponent >= 0 and self.mean_gap_ms > 0):
            raise ValueError("zipf_exponent must be >= 0 and mean_gap_ms > 0")

    def as_dict(self) -> dict[str, float]:
        """The parameters by name (for JSON)."""
        return asdict(self)


def rag_requests(shape: RagShape) -> list[TraceRequest]:
    """The RAG trace: system prompt, a document drawn by popularity, a one-off question.

    Hash ids: the system prompt's are ``0 .. system_blocks - 1``, each document's blocks have
    ids of their own (the same in every request that retrieves it), and each question's are
    new. The last block is partial (1 to ``BLOCK_SIZE`` tokens), as a prompt's usually is.

    Args:
        shape: the parameters.

    Returns:
        The requests, in arrival order.
    """
    rng = np.random.default_rng(shape.seed)
    lengths = rng.integers(
        shape.min_document_blocks, shape.max_document_blocks + 1, shape.num_documents
    )
    first_id = shape.system_blocks + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    popularity = np.arange(1, shape.num_documents + 1, dtype=float) ** -shape.zipf_exponent
    document_of_rank = rng.permutation(shape.num_documents)
    documents = document_of_rank[
        rng.choice(shape.num_documents, shape.num_requests, p=popularity / popularity.sum())
    ]
    questions = rng.integers(1, shape.max_question_blocks + 1, shape.num_requests)
    last_tokens = rng.integers(1, BLOCK_SIZE + 1, shape.num_requests)
    outputs = rng.integers(64, 513, shape.num_requests)
    arrivals = np.cumsum(rng.exponential(shape.mean_gap_ms, shape.num_requests))
    system = tuple(range(shape.system_blocks))
    next_id = shape.system_blocks + int(lengths.sum())
    requests = []
    for i, document in enumerate(documents):
        start = int(first_id[document])
        ids = (
            system
            + tuple(range(start, start + int(lengths[document])))
            + tuple(range(next_id, next_id + int(questions[i])))
        )
        next_id += int(questions[i])
        input_length = (len(ids) - 1) * BLOCK_SIZE + int(last_tokens[i])
        requests.append(TraceRequest(int(arrivals[i]), input_length, int(outputs[i]), ids))
    return requests


def conversation_requests(limit: int | None = None) -> list[TraceRequest]:
    """The shipped Mooncake conversation trace, or its first ``limit`` requests."""
    requests = read_trace(CONVERSATION_TRACE)
    return requests if limit is None else requests[:limit]
