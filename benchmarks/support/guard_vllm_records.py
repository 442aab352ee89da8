"""``benchmarks.guard``'s per-record figures in vLLM-CPU (``guard_records`` has our engine's):
SmolLM2-135M in fp32 through the connector, each vLLM a fresh process, one disk folder.

A storing process (guard off) serves a first prompt, the prompts to forge and the prompts whose
KV the ``other_tokens`` forgery puts in their place; its answers are the cold ones. The forged
prompts' records are rewritten by the benchmark's own disk tier under the storing process's
writer id (a buggy process among honest ones). Then a guarded process (the guard's defaults)
serves the first prompt (an honest first hit) and the forged ones, one at a time, vLLM's prefix
cache off so each asks the connector: half forged before it starts (``mixed``), half after its
first request (``after``). The deep-layer forgery (the last layer zeroed) and the noise below
the tolerance run in a process of their own each, as ``after``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from benchmarks.support.forgeries import Stored, forge_records, vllm_namespace

SALT = "records"
PROMPT_LEN = 100  # 6 records of 16
FIRST_LAYER = (
    "other_tokens",
    "k_and_v_swapped",
    "first_layer_zeroed",
    "heads_permuted",
    "noise_in_every_layer",
)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 48000) for _ in range(PROMPT_LEN)]


def vllm_record_cases(
    smollm2: Path, workdir: Path, guard: dict[str, Any], num: int, deep: bool = True
) -> dict[str, Any]:
    """The mixed-folder, after-check and (``deep``) deep-layer figures through vLLM-CPU
    (``num`` requests per case, spread over the first-layer forgeries)."""
    from benchmarks.support.guard_vllm import _serve

    disk = workdir / "vllm-records"
    first = _prompt(8000)
    targets = [_prompt(8001 + i) for i in range(2 * num)]
    others = [_prompt(9001 + i) for i in range(2 * num)]
    base = {"model": str(smollm2)}
    asked = [[SALT, p] for p in (first, *targets, *others)]
    stored = _serve(
        {
            **base,
            "kv_extra": {"cpu_bytes": 0, "disk_path": str(disk), "guard": False},
            "requests": asked,
        },
        workdir,
        "vllm-records-store",
    )
    cold = [r["token_ids"] for r in stored[1 : 1 + 2 * num]]
    forge = {"model": str(smollm2), "salt": SALT, "writer": _stored_writer(disk, smollm2, first)}

    def guarded(case: str, kinds: tuple[str, ...], before: slice, after: slice) -> list[bool]:
        chosen = [[kinds[i % len(kinds)], t, o] for i, (t, o) in enumerate(zip(targets, others))]
        case_disk = _copy(disk, workdir / f"vllm-records-{case}")
        forge_records({**forge, "disk": str(case_disk), "targets": chosen[before]})
        spec = {
            **base,
            # Every hit loaded: the cases check what a load serves, not whether it pays.
            "kv_extra": {
                "cpu_bytes": 0,
                "disk_path": str(case_disk),
                "kv_load_policy": "always",
                **guard,
            },
            "requests": [[SALT, first]] + [[SALT, t] for t in targets[before.start : after.stop]],
            "forge_after_first": {**forge, "disk": str(case_disk), "targets": chosen[after]},
        }
        rows = _serve(spec, workdir, f"vllm-records-{case}")[1:]
        return [r["token_ids"] != c for r, c in zip(rows, cold[before.start : after.stop])]

    # One process for both first-layer cases: forged before it starts, then after its first.
    wrong = guarded("mixed-after", FIRST_LAYER, slice(0, num), slice(num, 2 * num))
    out = {
        "vllm_mixed_folder_wrong_answers": sum(wrong[:num]),
        "vllm_after_check_wrong_answers": sum(wrong[num:]),
        "vllm_record_check_requests": num,
    }
    if deep:
        wrong = guarded("deep", ("deep_layer",), slice(0, 0), slice(0, num))
        out["vllm_deep_layer_forgery_wrong_answers_measured"] = sum(wrong)
        wrong = guarded("noise", ("noise_below_tolerance",), slice(0, 0), slice(0, num))
        out["vllm_noise_below_tolerance_wrong_answers"] = sum(wrong)
    return out


def _stored_writer(disk: Path, model: Path, tokens: list[int]) -> str:
    """The writer id the storing process's records name (hex)."""
    with Stored(disk, vllm_namespace(model, SALT)) as stored:
        writer = stored.records(tokens)[0].writer
    assert writer is not None
    return writer.hex()


def _copy(source: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(source, dest)
    return dest
