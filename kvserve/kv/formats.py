"""KV cache formats and what each costs, in one formula that sizing, `kvserve memory` and
`/metrics` all use:

    bytes per token = 2 · layers · kv_heads · head_dim · bits / 8  +  metadata per token
    plus, per sequence, the residual (int4: its open block, kept in the model's dtype)
    plus, once, fixed scales (fp8: one per layer and KV head, for K and for V)
    MLA (DeepSeek) instead: layers · (kv_lora_rank + qk_rope_head_dim) · bits / 8, the latent and
    its rotary key, no V; int8 and fp8 latents add a fp32 scale per token for each of the two

    format        bits  metadata                                        why
    float32/16    32/16 none                                            the model's own numbers
    bfloat16      16    none
    fp8_e4m3      8     fp32 scale per layer and KV head (fixed)        3 mantissa bits: needs a
                                                                         scale to use its range
    fp8_e5m2      8     fp32 scale per layer and KV head (fixed)        fp16's exponent: range
                                                                         enough, 2 mantissa bits
    int8          8     fp32 scale per token and KV head, K and V       symmetric: keys and
                                                                         values are centred
    int4          4     K: fp16 scale + zero per channel per block      KIVI: key outliers live
                        V: fp16 scale + zero per token per KV head      in channels, value ones
                        + the block being filled, unquantized           in tokens

int4 quantizes a block once it is full, so a full block never changes again (prefix caching
shares it); until then its tokens wait in full precision in a residual slot, one per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import DTYPE_BYTES, KV_CACHE_DTYPES, ModelConfig, canonical_kv_cache_dtype


@dataclass(frozen=True)
class KVFormat:
    name: str
    bits: int
    kind: str  # the storage that holds it: "dense", "fp8", "int8", "int4"

    @property
    def is_quantized(self) -> bool:
        return self.kind != "dense"

    def metadata_bytes_per_token(self, model: ModelConfig, block_size: int) -> float:
        if model.mla is not None and model.mla.caches_latent:  # a fp32 scale per token: latent, rotary key
            return model.num_hidden_layers * 2 * 4 if self.kind in ("int8", "fp8") else 0.0
        per_head = {"int8": 2 * 4,  # K and V: one fp32 scale each
                    "int4": 2 * 2 * model.head_dim / block_size + 2 * 2}.get(self.kind, 0.0)
        return model.num_hidden_layers * model.num_key_value_heads * per_head

    def bytes_per_token(self, model: ModelConfig, block_size: int = 16) -> float:
        if model.mla is not None and model.mla.caches_latent:  # layers x (kv_lora_rank + qk_rope), no V
            values = model.num_hidden_layers * model.mla.latent_dim * self.bits / 8
            return values + self.metadata_bytes_per_token(model, block_size)
        values = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * self.bits / 8
        return values + self.metadata_bytes_per_token(model, block_size)

    def fixed_bytes(self, model: ModelConfig) -> int:
        """Bytes the cache holds whatever its size (fp8's per-layer, per-head scales)."""
        latent = model.mla is not None and model.mla.caches_latent  # (a latent's scales are per token)
        return 2 * model.num_hidden_layers * model.num_key_value_heads * 4 if self.kind == "fp8" and not latent else 0

    def residual_bytes_per_sequence(self, model: ModelConfig, block_size: int, model_dtype: str) -> int:
        """int4's open block: block_size tokens of K and V in the model's dtype."""
        if self.kind != "int4":
            return 0
        return int(2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * block_size
                   * DTYPE_BYTES[model_dtype])


KV_FORMATS = {f.name: f for f in (
    KVFormat("float32", 32, "dense"), KVFormat("bfloat16", 16, "dense"), KVFormat("float16", 16, "dense"),
    KVFormat("fp8_e4m3", 8, "fp8"), KVFormat("fp8_e5m2", 8, "fp8"),
    KVFormat("int8", 8, "int8"), KVFormat("int4", 4, "int4"))}
assert set(KV_FORMATS) == set(KV_CACHE_DTYPES) - {"auto"}


def kv_format(name: str, model_dtype: str = "float32") -> KVFormat:
    """The format a --kv-cache-dtype names ("auto": the model's dtype); a ValueError names an
    unknown one and lists the rest."""
    key = canonical_kv_cache_dtype(name)
    return KV_FORMATS[model_dtype if key == "auto" else key]


def mha_bytes_per_token(fmt: KVFormat, model: ModelConfig, block_size: int = 16) -> float:
    """What the cache would cost if every query head had its own K/V head (plain MHA)."""
    if model.mla is not None:  # the latent expanded: every head's key (nope + rope) and value
        m = model.mla
        head = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
        return model.num_hidden_layers * model.num_attention_heads * head * fmt.bits / 8
    return fmt.bytes_per_token(model, block_size) * model.num_queries_per_kv


def check_format(fmt: KVFormat, model: ModelConfig, block_size: int, layout: str = "paged") -> None:
    """Refuse a format the model's shapes or the cache's layout cannot hold, naming why."""
    if fmt.kind == "int4" and model.mla is not None and model.mla.caches_latent:
        raise ValueError(f"kv cache dtype int4 is not offered for {model.name}'s latent (MLA) cache; "
                         "choose int8, fp8_e4m3 or a float dtype")
    if fmt.kind == "int4" and model.head_dim % 2:
        raise ValueError(f"kv cache dtype int4 packs two values a byte along head_dim, and this model's "
                         f"head_dim is {model.head_dim} (odd); choose int8 or fp8_e4m3")
    if fmt.kind == "int4" and layout == "contiguous":
        raise ValueError("kv cache dtype int4 quantizes a block once it is full, and a contiguous "
                         "layout's one block per sequence never fills; use the paged layout")
