"""cachetier for SGLang: its host KV pool's layouts as canonical blocks."""
