"""LLMEngine (add_request / step / abort) and LLM (offline generate)."""
