"""cachetier as a vLLM v1 KV connector: ``cachetier.connectors.vllm.connector.CacheTierConnector``.

Only modules of this package import vLLM; importing the package itself imports nothing heavy.
"""
