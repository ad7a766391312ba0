"""Evaluations through the engine's real cache: `kvserve eval perplexity`."""

# How `kvserve eval perplexity` cuts a text into windows (kvserve.eval.perplexity.Windows): every
# --stride tokens, each token scored once; or as llama.cpp's llama-perplexity does.
STRIDED, LLAMA_CPP = "strided", "llama.cpp"
WINDOWINGS = (STRIDED, LLAMA_CPP)
