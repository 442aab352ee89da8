"""The OpenAI-compatible HTTP server over ``LLMEngine`` (``python -m cachetier.engine.server``).

Nothing in the engine core imports this package: it is the HTTP edge, like ``cachetier.server``.
"""
