"""``benchmarks.models``' figures from its runs' outputs: what counts as run, identical and
restored, and the sliding layers' stored share against its bound."""

from __future__ import annotations

from benchmarks.models import FULL_BLOCK_TOKENS, PROMPT_TOKENS, sliding_bytes, summarize


def _run(tokens: list[int], cached: int, logprobs: list[float] | None = None) -> dict:
    out = {"token_ids": tokens, "cached": cached}
    if logprobs is not None:
        out["logprobs"] = logprobs
    return out


def test_an_architecture_is_identical_only_if_every_restore_matches_its_cold_run() -> None:
    full = FULL_BLOCK_TOKENS
    results = {
        "good": {
            "ours": {"cold": _run([1, 2], 0), "restart": _run([1, 2], full)},
            "vllm": {
                "cold": _run([1, 2], 0, [-0.5, -0.1]),
                "restart": _run([1, 2], full, [-0.5004, -0.1]),
                "from_our_engine": _run([1, 2], full, [-0.5, -0.1005]),
            },
        },
        "drifts": {  # a logprob off by more than the tolerance
            "vllm": {"cold": _run([3], 0, [-1.0]), "restart": _run([3], full, [-1.01])},
        },
        "partial": {"ours": {"cold": _run([4], 0), "restart": _run([4], full - 16)}},
        "refused": {"ours": {"refused": "ValueError: no"}, "vllm": {"refused": "ValueError: x"}},
        "engines_differ": {  # each restores its own run, but the two engines disagree cold
            "ours": {"cold": _run([5], 0), "restart": _run([5], full)},
            "vllm": {"cold": _run([6], 0, [-1.0]), "restart": _run([6], full, [-1.0])},
        },
    }
    figures = summarize(results)
    assert figures["architectures_run"] == 4 and figures["architectures"] == [
        "good",
        "drifts",
        "partial",
        "engines_differ",
    ]
    assert figures["architectures_identical"] == 1
    assert figures["architectures_not_identical"] == ["drifts", "partial", "engines_differ"]
    assert figures["tokens_restored_vs_full_blocks"]["partial@ours:restart"] == (full - 16) / full
    assert figures["tokens_restored_vs_full_blocks"]["good@vllm:from_our_engine"] == 1.0
    assert figures["refused_with_message"] == {
        "refused@ours": "ValueError: no",
        "refused@vllm": "ValueError: x",
    }


def test_the_sliding_share_counts_the_sliding_layers_of_each_layer_set() -> None:
    assert sliding_bytes([None, None], {"": 12}, block_tokens=16) is None
    # Every record holds every layer: the sliding layers are stored as whole as the rest.
    share = sliding_bytes([32, None, 64], {"": 12}, block_tokens=16)
    assert share == {"ratio": 1.0, "bound": 64 / PROMPT_TOKENS + 16 / PROMPT_TOKENS}
    assert sliding_bytes([32], {"": 3}, block_tokens=32)["ratio"] == 3 / 12
    # vLLM's groups: the full layers' set whole, the sliding layers' set a window of it.
    share = sliding_bytes([48, None, 48, None], {"1,3": 12, "0,2": 4}, block_tokens=32)
    assert share == {"ratio": 4 / 12, "bound": (48 + 32) / PROMPT_TOKENS}
    # A set that mixes kinds counts its sliding layers only.
    assert sliding_bytes([48, None], {"0,1": 6}, block_tokens=32)["ratio"] == 6 / 12
