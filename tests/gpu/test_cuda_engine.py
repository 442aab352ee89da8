"""Our engine on CUDA: weights, KV pool and forward on the GPU, through the same engine code the
CPU tests run (``EngineConfig.device``).

Each run records the logits of every step, and a GPU run is held to the CPU run of the same
requests step by step: fp32 logits within float rounding, the same greedy tokens. Restarts go
through a real disk tier, also across devices: blocks a GPU engine saved restore into a CPU
engine and the reverse (one block format on any device).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.store.config import StoreConfig

pytestmark = pytest.mark.cuda

# A prompt of 200 tokens in chunks of at most 96 runs every prefill path of the forward: a
# first chunk with nothing cached (> 64 new tokens: SDPA, causal), one after a cached context
# (SDPA with a mask), a short last chunk (grouped einsums); the 40-token prompt is a short
# first chunk, the third shares the first's leading blocks (a pool hit, then decodes that read
# those blocks together), and every decode step runs the Triton decode kernel.
PROMPTS = [
    [(7 * i + 3) % 250 + 3 for i in range(200)],
    [(11 * i + 5) % 250 + 3 for i in range(40)],
    [(7 * i + 3) % 250 + 3 for i in range(160)] + [9, 8, 7, 6, 5, 4, 3, 12, 13, 14],
]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ENGINE_ARGS = {"block_size": 16, "kv_cache_bytes": 8 << 20, "max_num_batched_tokens": 96}


def _run(
    model_dir: Path,
    device: str,
    prompts: list[list[int]],
    store: StoreConfig | None = None,
    **engine_args: object,
) -> tuple[list, list[torch.Tensor]]:
    """Outputs of ``prompts`` run together, and every step's logits (on the host)."""
    with LLM(model_dir, store=store, device=device, **{**ENGINE_ARGS, **engine_args}) as llm:
        steps: list[torch.Tensor] = []
        forward = llm.engine.model.forward

        def recording(*args: object, **kwargs: object) -> torch.Tensor:
            logits = forward(*args, **kwargs)
            assert logits.device == llm.engine.device
            steps.append(logits.cpu())
            return logits

        llm.engine.model.forward = recording  # type: ignore[method-assign]
        outputs = llm.generate(prompts, GREEDY)
        llm.flush()
    return outputs, steps


def _assert_same_run(want: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    """Step by step: logits within fp32 rounding of each other and the same greedy token,
    unless the reference's top two were a tie within that rounding (then the runs part ways
    and nothing later is comparable)."""
    assert got, "the run recorded no step"
    for step, (w, g) in enumerate(zip(want, got)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-3, msg=f"step {step}")
        flipped = w.argmax(-1) != g.argmax(-1)
        if flipped.any():
            top2 = w.topk(2, dim=-1).values
            assert bool(((top2[:, 0] - top2[:, 1])[flipped] < 2e-3).all()), f"step {step}"
            return
    assert len(got) == len(want)


def test_cuda_engine_matches_the_cpu_engine(tiny_model_dir: Path) -> None:
    cpu_out, cpu_steps = _run(tiny_model_dir, "cpu", PROMPTS)
    gpu_out, gpu_steps = _run(tiny_model_dir, "cuda", PROMPTS)
    _assert_same_run(cpu_steps, gpu_steps)
    assert [o.token_ids for o in gpu_out] == [o.token_ids for o in cpu_out]
    # The third prompt's first 160 tokens (10 blocks) came from the first's blocks in the pool.
    assert gpu_out[2].cached_tokens_by_source == cpu_out[2].cached_tokens_by_source
    assert gpu_out[2].cached_tokens_by_source.get("pool") == 160


def test_cuda_engine_restarts_warm_from_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = StoreConfig(cpu_bytes=0, disk_path=str(tmp_path / "disk"))
    prompt = [PROMPTS[0]]
    cold_out, cold_steps = _run(tiny_model_dir, "cuda", prompt, store)
    assert cold_out[0].num_cached_tokens == 0
    # A new engine (a restart: its pool is empty) finds the 12 full blocks on disk.
    warm_out, warm_steps = _run(tiny_model_dir, "cuda", prompt, store, kv_load_policy="always")
    assert warm_out[0].cached_tokens_by_source == {"disk": 192}
    assert warm_out[0].token_ids == cold_out[0].token_ids
    # The restored KV is the saved KV byte for byte, so only the suffix's chunking differs.
    _assert_same_run(cold_steps[-len(warm_steps) :], warm_steps)


@pytest.mark.parametrize(("saver", "loader"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_blocks_saved_on_one_device_restore_on_the_other(
    tiny_model_dir: Path, tmp_path: Path, saver: str, loader: str
) -> None:
    store = StoreConfig(cpu_bytes=0, disk_path=str(tmp_path / "disk"))
    prompt = [PROMPTS[0]]
    _run(tiny_model_dir, saver, prompt, store)
    warm_out, warm_steps = _run(tiny_model_dir, loader, prompt, store, kv_load_policy="always")
    assert warm_out[0].cached_tokens_by_source == {"disk": 192}
    # The loader's own restart from its own saved blocks: the same suffix step on one device.
    own = StoreConfig(cpu_bytes=0, disk_path=str(tmp_path / "own"))
    _run(tiny_model_dir, loader, prompt, own)
    own_out, own_steps = _run(tiny_model_dir, loader, prompt, own, kv_load_policy="always")
    assert own_out[0].cached_tokens_by_source == {"disk": 192}
    _assert_same_run(own_steps, warm_steps)
    assert warm_out[0].token_ids == own_out[0].token_ids


def test_a_tail_read_beside_the_head_on_cuda_gives_the_same_tokens(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """On a GPU every tier's tail is read on the bridge's thread while the head computes; the
    pool's copies from that thread must land whole before the jump over them."""
    from cachetier.store.costmodel import LoadPlan

    class Split:
        def plan(self, spans: list[tuple[str, int]], **kw: object) -> LoadPlan:
            total = sum(n for _, n in spans)
            return LoadPlan(total, 3, total, "model")

    store = StoreConfig(cpu_bytes=0, disk_path=str(tmp_path / "disk"))
    prompt = [PROMPTS[0]]
    cold_out, _ = _run(tiny_model_dir, "cuda", prompt, store)
    with LLM(tiny_model_dir, store=store, device="cuda", **ENGINE_ARGS) as llm:
        assert llm.engine.scheduler.background_tiers == {"disk"}
        llm.engine.scheduler.cost = Split()  # type: ignore[assignment]
        (warm,) = llm.generate(prompt, GREEDY)
    assert warm.cached_tokens_by_source == {"disk": 192 - 3 * 16}
    assert warm.token_ids == cold_out[0].token_ids
