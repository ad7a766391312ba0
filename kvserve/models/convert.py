"""A GGUF as a Hugging Face directory, for the engines that read only those (transformers'
generate, vLLM): transformers dequantizes the GGUF to fp32 on loading, and the directory holds
those plain weights and the GGUF's tokenizer. Needs transformers (a test and benchmark extra)."""

from __future__ import annotations

import os


def gguf_to_hf_directory(gguf: str, out_dir: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    where, name = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized on loading: saved as the plain weights they now are
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(out_dir)
    return out_dir
