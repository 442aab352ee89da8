"""One KV block format for every engine: blocks saved by one engine restore into another.

SmolLM2 in float32, one model fingerprint and tenant, and each engine at its own block size:
HF and our engine at 16 tokens (their default), vLLM-CPU at 32, every one keying records of the
default ``record_tokens`` (16), so all three key the same prompt with the same keys and vLLM
reads and writes two records per block. Each engine runs in a fresh process
(this file is also the script it runs):

1. ``torch-save``: HF stores ``PROMPTS["hf"]`` and our engine ``PROMPTS["engine"]`` in folder A;
   both also run ``PROMPTS["vllm"]`` cold (their own reference).
2. ``vllm``: vLLM runs all three prompts cold with the connector on an empty folder B (its
   reference, and the blocks it stores there), then restarts on folder A and runs the HF and
   engine prompts, which it must restore.
3. ``torch-restore``: HF and our engine run ``PROMPTS["vllm"]`` on folder B, restoring vLLM's
   blocks.

Each pair A->B must restore every full block and give exactly B's own cold greedy tokens; HF
and vLLM also report logprobs, which must agree with the cold run's within ``LOGPROB_ATOL``.
Our engine reports no logprobs; for it the tokens are compared, and the records every engine
wrote for the same key must hold the same KV within ``KV_ATOL`` (a wrong arrangement is off
by the size of the values themselves, ~20, not by rounding).

A deployment that changes ``record_tokens`` changes the namespace: a clean miss for engines
still at the old size, never a re-chunked record (``test_keys``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.children import run_spec_module, spec_main

VLLM_BLOCK_SIZE = 32
RECORD_TOKENS = (
    16  # cachetier.primitives.kv_format.DEFAULT_RECORD_TOKENS, and HF's and our engine's block
)
PROMPT_LEN = 4 * VLLM_BLOCK_SIZE + 5  # 4 vLLM blocks restored; the last 5 tokens are computed
FULL_BLOCKS = 4  # of vLLM's
CACHED_TOKENS = FULL_BLOCKS * VLLM_BLOCK_SIZE
MAX_TOKENS = 6
LOGPROB_ATOL = 1e-3
KV_ATOL = 1e-3
RUN_TIMEOUT_S = 900

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.model,
    pytest.mark.slow(reason="starts HF, engine and vLLM-CPU processes that each load SmolLM2"),
]


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 48000) for _ in range(PROMPT_LEN)]


PROMPTS = {"hf": _prompt(151), "engine": _prompt(152), "vllm": _prompt(153)}


# The subprocess side.


def _hf_generate(model: Any, prompt: list[int], connector: Any | None) -> dict[str, Any]:
    import torch

    kwargs = dict(
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    if connector is None:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        cached = 0
    else:
        out, info = connector.generate(prompt, **kwargs)
        cached = info.num_cached_tokens
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        float(torch.log_softmax(score[0].float(), dim=-1)[token])
        for score, token in zip(out.scores, tokens)
    ]
    return {"token_ids": tokens, "logprobs": logprobs, "num_cached_tokens": cached}


def _engine_generate(llm: Any, prompt: list[int]) -> dict[str, Any]:
    from cachetier.engine.sampling import SamplingParams

    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return {"token_ids": list(out.token_ids), "num_cached_tokens": out.num_cached_tokens}


def _run_torch(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from cachetier.connectors.hf import HFCacheConnector
    from cachetier.engine.llm import LLM
    from cachetier.store.config import StoreConfig, build_store

    folder = spec["model"]
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    store_config = StoreConfig(cpu_bytes=0, disk_path=spec["disk"])
    results: dict[str, Any] = {}
    store = build_store(store_config)
    try:
        hf = HFCacheConnector(model, store, model_folder=folder)  # the README's defaults
        for name, prompt in spec["hf"].items():
            results[f"hf:{name}"] = _hf_generate(model, prompt, hf)
        for name, prompt in spec["hf_cold"].items():
            results[f"hf-cold:{name}"] = _hf_generate(model, prompt, None)
    finally:
        store.close()
    # 16-token blocks; the guard off: each engine must restore what another wrote at once.
    engine_args = dict(kv_cache_bytes=64 << 20, max_model_len=512, guard=False)
    with LLM(folder, store=store_config, **engine_args) as llm:
        for name, prompt in spec["engine"].items():
            results[f"engine:{name}"] = _engine_generate(llm, prompt)
    with LLM(folder, store=None, **engine_args) as llm:
        for name, prompt in spec["engine_cold"].items():
            results[f"engine-cold:{name}"] = _engine_generate(llm, prompt)
    return results


def _run_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    import gc

    from vllm import LLM, SamplingParams

    from cachetier.connectors.vllm.launch import kv_transfer_config

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    results: dict[str, Any] = {}
    for run in spec["runs"]:
        llm = LLM(
            model=spec["model"],
            dtype="float32",
            enforce_eager=True,
            block_size=VLLM_BLOCK_SIZE,
            max_model_len=512,
            seed=0,
            kv_transfer_config=kv_transfer_config(
                {"cpu_bytes": 0, "disk_path": run["disk"], "guard": False}
            ),
        )
        for name, prompt in run["prompts"].items():
            (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            results[f"vllm-{run['name']}:{name}"] = {
                "token_ids": tokens,
                "logprobs": [
                    float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)
                ],
                "num_cached_tokens": output.num_cached_tokens,
            }
        del llm
        gc.collect()
    return results


def main() -> None:
    spec_main(lambda spec: _run_vllm(spec) if spec["kind"] == "vllm" else _run_torch(spec), __doc__)


# The pytest side.


def _child(workdir: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    results, _ = run_spec_module(
        "tests.connectors.test_cross_engine", spec, workdir, name, timeout=RUN_TIMEOUT_S
    )
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("cross-engine")
    from_torch, from_vllm = workdir / "from-torch", workdir / "from-vllm"
    model = str(smollm2_dir)
    results: dict[str, Any] = {"folders": {"torch": from_torch, "vllm": from_vllm}}
    results |= _child(
        workdir,
        "torch-save",
        {
            "kind": "torch",
            "model": model,
            "disk": str(from_torch),
            "hf": {"hf": PROMPTS["hf"]},
            "hf_cold": {"vllm": PROMPTS["vllm"]},
            "engine": {"engine": PROMPTS["engine"]},
            "engine_cold": {"vllm": PROMPTS["vllm"]},
        },
    )
    results |= _child(
        workdir,
        "vllm",
        {
            "kind": "vllm",
            "model": model,
            "runs": [
                {"name": "cold", "disk": str(from_vllm), "prompts": PROMPTS},
                {
                    "name": "restore",
                    "disk": str(from_torch),
                    "prompts": {"hf": PROMPTS["hf"], "engine": PROMPTS["engine"]},
                },
            ],
        },
    )
    results |= _child(
        workdir,
        "torch-restore",
        {
            "kind": "torch",
            "model": model,
            "disk": str(from_vllm),
            "hf": {"vllm": PROMPTS["vllm"]},
            "hf_cold": {},
            "engine": {"vllm": PROMPTS["vllm"]},
            "engine_cold": {},
        },
    )
    return results


# (restored run, cold reference) of engine B for each pair A->B.
PAIRS = {
    "hf->vllm-cpu": ("vllm-restore:hf", "vllm-cold:hf"),
    "engine->vllm-cpu": ("vllm-restore:engine", "vllm-cold:engine"),
    "vllm-cpu->engine": ("engine:vllm", "engine-cold:vllm"),
    "vllm-cpu->hf": ("hf:vllm", "hf-cold:vllm"),
}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_blocks_of_one_engine_restore_into_another(runs: dict[str, Any], pair: str) -> None:
    restored_name, cold_name = PAIRS[pair]
    restored, cold = runs[restored_name], runs[cold_name]
    assert restored["num_cached_tokens"] == CACHED_TOKENS, (pair, restored)
    assert cold["num_cached_tokens"] == 0
    assert restored["token_ids"] == cold["token_ids"], pair
    if "logprobs" in cold:
        for step, (got, want) in enumerate(zip(restored["logprobs"], cold["logprobs"])):
            assert abs(got - want) <= LOGPROB_ATOL, (pair, step, got, want)


def test_every_engine_writes_the_same_kv_for_the_same_key(runs: dict[str, Any]) -> None:
    import numpy as np

    from cachetier.record import decode_record

    def records(folder: Path) -> dict[bytes, Any]:
        found = {}
        for path in folder.rglob("*.ctkv"):
            record = decode_record(path.read_bytes())
            found[bytes(record.key)] = record
        return found

    from_torch, from_vllm = (records(runs["folders"][k]) for k in ("torch", "vllm"))
    shared = set(from_torch) & set(from_vllm)
    # HF's and the engine's prompts, 8 records each, stored by both sides.
    num_records = CACHED_TOKENS // RECORD_TOKENS
    assert len(shared) == 2 * num_records, (len(from_torch), len(from_vllm), len(shared))
    for key in shared:
        a, b = from_torch[key], from_vllm[key]
        assert tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype == "float32"
        assert a.num_tokens == b.num_tokens == RECORD_TOKENS
        diff = np.abs(np.frombuffer(a.data, "<f4") - np.frombuffer(b.data, "<f4")).max()
        assert diff <= KV_ATOL, (key.hex()[:12], diff)


if __name__ == "__main__":
    main()
