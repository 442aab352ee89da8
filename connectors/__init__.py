"""Plug cachetier's tiers into other engines: vLLM (KVConnectorBase_V1) and HF transformers.

Our own engine reaches the tiers through ``cachetier.engine.tier_bridge``; nothing here imports it.
"""
