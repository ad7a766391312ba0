"""llama2.c checkpoints (version 0): a 7-int32 header, then fp32 tensors in a fixed order.

header: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative
vocab_size means the classifier is stored separately (untied). Tensor order: token embedding,
then each kind for all layers: rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3; rms_final; the
RoPE tables (skipped); wcls if untied. Weights are [out, in], like torch.nn.Linear.
"""

from __future__ import annotations

import os
import struct
from typing import Optional

import numpy as np
import torch

from kvserve.config import ModelConfig
from kvserve.models.loaders.base import LoadedModel, ModelLoadError, interleaved_to_half_rope
from kvserve.tokenizer.llama2c import Llama2cTokenizer, find_llama2c_tokenizer

HEADER = struct.Struct("<7i")


def read_config(path: str) -> ModelConfig:
    with open(path, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise ModelLoadError(f"{path}: too short for a llama2.c checkpoint header")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = HEADER.unpack(raw)
    if min(dim, hidden, layers, heads, kv_heads, seq_len) <= 0 or vocab == 0 or dim % heads:
        raise ModelLoadError(f"{path}: not a llama2.c checkpoint (header {HEADER.unpack(raw)})")
    return ModelConfig(vocab_size=abs(vocab), hidden_size=dim, intermediate_size=hidden,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=vocab > 0,
                       architecture="llama2c", name=os.path.splitext(os.path.basename(path))[0])


def load(path: str, tokenizer_path: Optional[str] = None) -> LoadedModel:
    cfg = read_config(path)
    data = np.fromfile(path, dtype=np.float32, offset=HEADER.size)
    sd = _state_dict(cfg, data, path)
    tok_path = find_llama2c_tokenizer(os.path.dirname(os.path.abspath(path)), tokenizer_path)
    tokenizer = Llama2cTokenizer.from_file(tok_path, cfg.vocab_size) if tok_path else None
    return LoadedModel(cfg, sd, tokenizer, f"llama2c:{os.path.abspath(path)}:{os.path.getsize(path)}")


def _state_dict(cfg: ModelConfig, data: np.ndarray, path: str) -> dict[str, torch.Tensor]:
    d, hd, L, v = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers, cfg.vocab_size
    q_dim, kv_dim, ff = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    shapes = [("embed", (v, d)), ("rms_att", (L, d)), ("wq", (L, q_dim, d)), ("wk", (L, kv_dim, d)),
              ("wv", (L, kv_dim, d)), ("wo", (L, d, q_dim)), ("rms_ffn", (L, d)), ("w1", (L, ff, d)),
              ("w2", (L, d, ff)), ("w3", (L, ff, d)), ("rms_final", (d,)),
              ("rope", (2, cfg.max_position_embeddings, hd // 2))]
    if not cfg.tie_word_embeddings:
        shapes.append(("wcls", (v, d)))
    needed = sum(int(np.prod(s)) for _, s in shapes)
    if data.size < needed:
        raise ModelLoadError(f"{path}: holds {data.size} floats, the header implies {needed}")
    t, off = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        t[name] = torch.from_numpy(data[off:off + n].copy()).view(shape)
        off += n
    sd = {"model.embed_tokens.weight": t["embed"], "model.norm.weight": t["rms_final"]}
    for i in range(L):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": t["rms_att"][i],
            p + "self_attn.q_proj.weight": interleaved_to_half_rope(t["wq"][i], cfg.num_attention_heads),
            p + "self_attn.k_proj.weight": interleaved_to_half_rope(t["wk"][i], cfg.num_key_value_heads),
            p + "self_attn.v_proj.weight": t["wv"][i], p + "self_attn.o_proj.weight": t["wo"][i],
            p + "post_attention_layernorm.weight": t["rms_ffn"][i], p + "mlp.gate_proj.weight": t["w1"][i],
            p + "mlp.down_proj.weight": t["w2"][i], p + "mlp.up_proj.weight": t["w3"][i]})
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = t["wcls"]
    return sd
