"""The Llama-family model, its loaders (GGUF, Hugging Face, llama2.c) and the model registry."""
