"""The OpenAI-compatible HTTP API over one engine loop."""
