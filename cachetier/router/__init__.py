"""``cachetier route``: a KV-aware, OpenAI-compatible router in front of engine replicas.

- ``config``: ``RouterConfig``;
- ``replicas``: the replicas, polled for health, load and measured rates;
- ``prompt``: the prompt's token ids as the engine computes them;
- ``decide``: the policy's order of replicas, from the prefix index and the replicas' figures;
- ``proxy``: forwarding, with retries on another replica before the first byte;
- ``app``: the HTTP app and its metrics.
"""
