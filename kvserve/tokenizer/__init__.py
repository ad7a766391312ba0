"""Tokenizers behind one interface: Hugging Face `tokenizers` (GGUF and HF files) and llama2.c."""
