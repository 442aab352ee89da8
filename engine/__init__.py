"""A small paged inference engine for Llama-family models, with prefix caching over cachetier."""
