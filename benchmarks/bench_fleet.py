"""KV-aware routing (issue 55) in a live fleet: three engine-server replicas of SmolLM2 with
node-local disk tiers, one sidecar every replica reads, and ``cachetier route`` in front, all
real processes on this machine; plus the simulated fleets of ``benchmarks.fleet_sim``.

    python -m benchmarks.bench_fleet --json [--quick]
    python benchmarks/bench_fleet.py --json

The live replay (``benchmarks.support.fleet_live_requests``): multi-turn sessions of the
shipped conversation trace, one engine block (16 tokens) per trace hash id, as token-id
completions streamed through the router, 8 tokens each; TTFT is timed at the client, from the
POST to the first streamed token. Each replica: a pool of ``--pool-blocks`` blocks (a few
prompts: the tiers below matter), a disk tier that keeps all it computes, no CPU tier, the
sidecar below that; one torch thread (three replicas share two cores). The sidecar's one tier
holds ``--shared-fraction`` of the blocks the replay needs. Every replica publishes KV events
and the router follows them and the sidecar's.

Figures (each a ratio or a duration of this run; ``targets`` says what each should be):

- ``tier_aware_ttft_vs_round_robin``, ``tier_aware_ttft_vs_pool_only``: mean TTFT of
  ``tier_aware`` over that of each baseline, the same requests on the same arrival schedule,
  each policy on a fleet of its own started empty (``benchmarks.support.fleet_live_runs``).
  Arrivals are Poisson at ``--utilization`` of what the first fleet serves cold (its cold
  rounds: one new prompt per replica at once); every policy's own figures are under
  ``policies``.
- ``failed_requests_with_replica_killed``: after its measured requests, the tier-aware fleet
  replays other sessions at the same rate, and replica r1 is SIGKILLed a fifth of the way
  through, at its first moment with a request in flight (``victim_in_flight_at_kill``: a kill
  of an idle replica tests nothing), and started again at once on its port and disk folder;
  requests that failed at the client (a status other than 200, a broken stream, no
  ``[DONE]``), with those that failed after their first token apart (no router can retry
  those).
- ``restarted_replica_blocks_routable_s``: from the new r1 process's spawn until the router's
  ``/v1/fleet/index`` holds as many of its disk blocks, under its new epoch, as its own
  ``/v1/fleet/state`` digest reports (more than none); ``..._after_healthy_s`` from its first
  good ``/healthz``, which most of the first figure is (loading the model).
- ``index_stale_after_lost_events_s``: events lost the way a busy replica loses them, a
  publisher queue of one batch (``--kv-events-queue 1``) on every replica of a fleet of its
  own (tier-aware), whose requests come in one burst, so publishes overflow it
  (``num_dropped_events``). Once the last answer is in: the time until the index agrees with
  every replica on every node-local medium (count and XOR digest), against the router's
  ``reconcile_interval_s``; ``disagreed_at_stop`` names the replicas it was wrong about then
  (none: the figure shows nothing), and ``settled_s`` is when the replicas' own digests last
  moved (their tier writes can outlive the last answer).
- ``simulated``: ``benchmarks.fleet_sim``'s headline figures (its quick variant with
  ``--quick``), and ``tier_aware`` over ``pool_only`` per size.

``--replicas N --pin``: N replicas, each pinned to a core of its own (``taskset``), so one
replica's load does not slow another; the sidecar, the router and the client share all cores.
On a two-core machine, ``--replicas 2 --pin`` is the fleet whose replicas are independent.

``--quick``: four sessions per phase, only the three policies the headline compares, the
simulated quick variant: a smoke test of every path (minutes: each fleet loads SmolLM2 three
times).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a path, the benchmarks package is not importable: run again as ``python -m``,
    # with the checkout's root on PYTHONPATH (the working folder stays the caller's).
    _root = str(Path(__file__).resolve().parents[1])
    _path = os.pathsep.join(filter(None, [_root, os.environ.get("PYTHONPATH")]))
    _argv = [sys.executable, "-m", "benchmarks.bench_fleet", *sys.argv[1:]]
    os.execve(sys.executable, _argv, {**os.environ, "PYTHONPATH": _path})

from benchmarks.support.fleet_live_main import main  # noqa: E402

if __name__ == "__main__":
    main(__doc__ or "")
