"""Evaluations through the engine's real cache: `kvserve eval perplexity`."""
