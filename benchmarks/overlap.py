"""Would a restore overlapped with the forward pay here? Measured before building one.

Issue 17 lists "restore layer by layer, overlapped with the suffix prefill of the layers already
there" among the ways to cut a restarted engine's TTFT. That only pays where reading the blocks
and running the forward use different resources. This times, in one engine process (SmolLM2
fp32 by default, a 4,111-token prompt whose blocks are in the disk tier):

- ``forward_s``: the prompt again with every block in the pool (a pool hit: the 15-token
  suffix forward and one sampled token), what the restore would hide behind;
- ``reads_s``: the disk tier reading every block of the prompt (the restore's read, checksums
  included, page cache warm), alone;
- ``together_s``: both at once, the reads on a thread started just before the forward, until
  both are done.

Rounds interleave the three; medians are kept. ``overlap_saved_fraction`` = (forward + reads -
together) / reads: 1.0 if the reads hide entirely behind the forward (a pipelined restore would
save all of them), 0 if running them together saves nothing (the machine has no idle resource
for them: do not build it here). ``--device cuda`` runs the forward on a GPU, where the reads
and the forward use different processors.

    python -m benchmarks.overlap --json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from typing import Any

from benchmarks.support.output import emit
from benchmarks.support.workdir import disk_work_dir


def measure(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    from cachetier.engine.demo import build_prompt
    from cachetier.engine.llm import LLM
    from cachetier.engine.sampling import SamplingParams
    from cachetier.engine.smollm2 import smollm2_path
    from cachetier.primitives.keys import block_keys
    from cachetier.store.config import StoreConfig

    store = StoreConfig(cpu_bytes=0, disk_path=folder, disk_bytes=16 << 30)
    one_token = SamplingParams(temperature=0, max_tokens=1)
    with LLM(
        args.model or smollm2_path(),
        store=store,
        kv_cache_bytes=3 << 30,
        max_num_batched_tokens=args.tokens + 64,
        device=args.device,
        guard=False,  # the restore is measured; the guard's cost is benchmarks.guard's figure
    ) as llm:
        if llm.tokenizer is not None:
            prompt = build_prompt(llm, args.tokens)
        else:  # a model folder without a tokenizer (a test's): ordinary token ids
            prompt = [3 + (7919 * i) % 250 for i in range(args.tokens + 15)]
        llm.generate([prompt], one_token)  # the cold prefill stores every full block
        llm.flush()
        engine = llm.engine
        bridge = engine.bridge
        assert bridge is not None
        namespace = engine.namespace
        keys = block_keys(namespace, prompt)
        tiers = {tier.name: tier for tier in bridge.store.tiers}
        disk = tiers["disk"]
        restored_bytes = 0

        def read_all() -> None:
            nonlocal restored_bytes
            blocks = disk.get_many(namespace.id, keys)
            if not all(block is not None for block in blocks):
                raise RuntimeError("the disk tier lost blocks of the prompt")
            restored_bytes = sum(memoryview(b.data).nbytes for b in blocks if b is not None)

        def forward() -> float:
            out = llm.generate([prompt], one_token)[0]
            if out.cached_tokens_by_source.get("pool", 0) < len(keys) * namespace.block_size:
                raise RuntimeError(f"not a pool hit: {out.cached_tokens_by_source}")
            return out.ttft_s

        read_all()  # the page cache warm, buffers set up
        forward()
        samples: dict[str, list[float]] = {"forward_s": [], "reads_s": [], "together_s": []}
        for _ in range(args.rounds):
            samples["forward_s"].append(forward())
            start = time.perf_counter()
            read_all()
            samples["reads_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            reader = threading.Thread(target=read_all)
            reader.start()
            forward()
            reader.join()
            samples["together_s"].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    hidden = medians["forward_s"] + medians["reads_s"] - medians["together_s"]
    return {
        "device": args.device,
        "prompt_tokens": len(prompt),
        "restored_bytes": restored_bytes,
        "rounds": args.rounds,
        **{name: round(value, 5) for name, value in medians.items()},
        "overlap_saved_fraction": round(hidden / medians["reads_s"], 3),
        "runs_s": {name: [round(v, 5) for v in values] for name, values in samples.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--model", default=None, help="model folder (default: the converted SmolLM2-135M)"
    )
    parser.add_argument(
        "--work-dir", default=None, help="parent of the disk tier's temp folder (on a disk)"
    )
    args = parser.parse_args()
    parent = disk_work_dir(args.work_dir, "--work-dir")
    with tempfile.TemporaryDirectory(prefix="bench-overlap-", dir=parent) as folder:
        emit(measure(args, folder), args.json)


if __name__ == "__main__":
    main()
