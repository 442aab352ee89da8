"""Plug cachetier's tiers into engines: our engine, vLLM (KVConnectorBase_V1), HF transformers."""
