"""Real vLLM (CPU) with the restore guard on: forged records that pass every checksum are
caught through the connector, quarantined, and never change an answer.

Process A stores three prompts on disk, each under its own cache salt (its own namespace).
The test then forges each prompt's records in place: K and V swapped, another arrangement
labelled canonical, another prompt's KV under this prompt's keys. Process B runs vLLM with
``"guard": true``: each prompt's first hit is computed and compared, its namespace quarantined
in the disk tier, and each prompt asked again (vLLM's own prefix cache off, so the tiers are
asked) is computed too. Every answer equals the baseline's.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from benchmarks.support.forgeries import (
    Stored,
    another_arrangement,
    k_and_v_swapped,
    values_of,
    vllm_namespace,
)
from tests.children import run_spec_module, spec_main

BLOCK_SIZE = 32
PROMPT_LEN = 200  # 6 full blocks of 32, 12 records of 16
MAX_TOKENS = 4
SALTS = ("kv-swapped", "arrangement", "other-tokens")
RUN_TIMEOUT_S = 600

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 48000) for _ in range(PROMPT_LEN)]


PROMPTS = {salt: _prompt(7100 + i) for i, salt in enumerate(SALTS)}
OTHER = _prompt(7199)  # whose KV the third forgery serves


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    """The child: one vLLM engine, each request of ``spec["requests"]`` in turn."""
    from vllm import LLM, SamplingParams

    from cachetier.connectors.vllm.launch import kv_transfer_config

    kwargs: dict[str, Any] = {}
    if spec["kv_extra"] is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(spec["kv_extra"])
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        seed=0,
        enable_prefix_caching=False,  # every request asks the connector
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out = []
    for salt, tokens in spec["requests"]:
        prompt = {"prompt_token_ids": tokens, "cache_salt": salt}
        (result,) = llm.generate([prompt], params, use_tqdm=False)
        out.append(
            {
                "salt": salt,
                "cached": result.num_cached_tokens,
                "token_ids": list(result.outputs[0].token_ids),
            }
        )
    llm.llm_engine.engine_core.shutdown()
    return {"outputs": out}


def _forge(disk: Path, model_dir: Path) -> None:
    """Rewrite each prompt's records on disk as its forgery, keeping keys and fingerprints."""
    for salt, tokens in PROMPTS.items():
        with Stored(disk, vllm_namespace(model_dir, salt)) as stored:
            records = stored.records(tokens)
            if salt == "kv-swapped":
                forged = k_and_v_swapped(records)
            elif salt == "arrangement":
                forged = another_arrangement(records)
            else:
                forged = values_of(stored.records(OTHER))(records)
            stored.replace(records, forged)


def test_forgeries_are_caught_through_the_connector_and_never_served(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    disk = tmp_path / "disk"
    store = {"cpu_bytes": 0, "disk_path": str(disk)}
    requests = [[salt, tokens] for salt, tokens in PROMPTS.items()]
    base = {"model": str(smollm2_dir)}
    baseline, _ = run_spec_module(
        __name__,
        {**base, "kv_extra": None, "requests": requests},
        tmp_path,
        "baseline",
        timeout=RUN_TIMEOUT_S,
    )
    stored_requests = [*requests, ["other-tokens", OTHER]]
    run_spec_module(
        __name__,
        {**base, "kv_extra": store, "requests": stored_requests},
        tmp_path,
        "store",
        timeout=RUN_TIMEOUT_S,
    )
    _forge(disk, smollm2_dir)
    guarded = {**store, "guard": True, "guard_first_hits": 1, "guard_fraction": 0.0}
    twice = [r for r in requests for _ in range(2)]
    result, log = run_spec_module(
        __name__,
        {**base, "kv_extra": guarded, "requests": twice},
        tmp_path,
        "guarded",
        timeout=RUN_TIMEOUT_S,
    )
    want = {o["salt"]: o["token_ids"] for o in baseline["outputs"]}
    for out in result["outputs"]:
        assert out["token_ids"] == want[out["salt"]], out["salt"]
        assert out["cached"] == 0, out  # verified first, quarantined after: always computed
    assert log.count("verifying") == len(SALTS), log[-4000:]
    warnings = [line for line in log.splitlines() if "does not match a recomputation" in line]
    assert len(warnings) == len(SALTS), log[-4000:]


if __name__ == "__main__":
    spec_main(_run, __doc__)
