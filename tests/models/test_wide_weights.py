"""A GGUF's F16 and BF16 matrices under an fp32 model stay 16-bit (models/packed.py's
WIDE_FORMATS): half the bytes, and the same logits (1e-5) and greedy tokens as the fp32 cast
(`--weight-dtype float32`) and as transformers with its weights rounded the same way; the
products with the compiled kernel and without it agree; a bf16 model is built as before."""

import copy

import numpy as np
import pytest
import torch

from kvserve.models.packed import WIDE_FORMATS, PackedEmbedding, PackedLinear, keep_wide
from tests.conftest import greedy, make_engine, run_collecting_logits
from tests.models.test_dense_families import GGUF_NAMES, permute
from tests.models.test_hf_parity import full_logits

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=None,
              bos_token_id=None, eos_token_id=None)
KINDS = {"F16": torch.float16, "BF16": torch.bfloat16}


def tiny_llama(tied):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, tie_word_embeddings=tied)).eval()
    with torch.no_grad():  # norms and embeddings away from their initial values: make them count
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    return hf


def write_llama_gguf(path, hf, matrices):
    """llama.cpp's tensors and metadata; the matrices in `matrices` (F16 or BF16), norms in F32."""
    cfg, sd = hf.config, {k: v.numpy() for k, v in hf.state_dict().items()}
    kind = gguf.GGMLQuantizationType[matrices]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers), w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size), w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads), w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps), w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size), w.add_tokenizer_model("gpt2"), w.add_token_merges(["t 0"])
    w.add_token_list(["t", "0", "t0"] + [f"x{i}" for i in range(3, cfg.vocab_size)])

    def add(name, a):
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.ndim == 1:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)

    add("token_embd.weight", sd["model.embed_tokens.weight"]), add("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    for key, a in sd.items():
        if key.startswith("model.layers."):
            i, inner = key.split(".")[2], ".".join(key.split(".")[3:-1])
            if inner in ("self_attn.q_proj", "self_attn.k_proj"):
                a = permute(a, cfg.num_attention_heads if "q_proj" in inner else cfg.num_key_value_heads)
            add(f"blk.{i}.{GGUF_NAMES[inner]}.weight", a)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=[("F16", False), ("BF16", True)], ids=["f16", "bf16-tied"])
def sixteen_bit(request, tmp_path_factory):
    """(the 16-bit dtype, transformers' model with its matrices rounded to it, kvserve's load)."""
    from kvserve.models.registry import load_weights
    matrices, tied = request.param
    hf = tiny_llama(tied)
    path = tmp_path_factory.mktemp("wide") / f"llama-{matrices}.gguf"
    write_llama_gguf(path, hf, matrices)
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() == 2:
                p.copy_(p.to(KINDS[matrices]).float())
    return KINDS[matrices], rounded, load_weights(str(path))


def matrix_params(model):
    """(16-bit matrices: their count and bytes; fp32 matrices: their count) of a built model."""
    wide = [m for m in model.modules()
            if isinstance(m, (PackedLinear, PackedEmbedding)) and m.fmt.kernel == "linear_wide"]
    unique = {id(m.qweight): m.qweight for m in wide}.values()  # a tied head shares the embedding's table
    dense = [p for name, p in model.named_parameters() if p.dim() == 2]
    return len(wide), sum(q.numel() for q in unique), sum(p.numel() for p in dense)


def test_an_fp32_model_keeps_the_matrices_16_bit(sixteen_bit):
    from kvserve.models.registry import build_model
    dtype, _, loaded = sixteen_bit
    model = build_model(loaded, torch.float32, "cpu", 512)
    cast = build_model(loaded, torch.float32, "cpu", 512, weight_dtype="float32")
    num_wide, wide_bytes, dense = matrix_params(model)
    _, _, cast_params = matrix_params(cast)
    fmt = WIDE_FORMATS[dtype]
    assert isinstance(model.model.embed_tokens, PackedEmbedding) and model.model.embed_tokens.fmt == fmt
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.fmt == fmt
    assert num_wide == 2 + 4 * CONFIG["num_hidden_layers"]  # embedding, head; q|k|v, o, gate|up, down a layer
    assert dense == 0 and wide_bytes == 2 * cast_params  # every matrix: 2 bytes a weight, not 4
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # norms (and biases) in the model dtype
    bf16 = build_model(loaded, torch.bfloat16, "cpu", 512)  # a 16-bit model: plain weights, as before
    assert matrix_params(bf16)[0] == 0 and bf16.lm_head.weight.dtype == torch.bfloat16


def test_logits_equal_the_fp32_cast_and_transformers(sixteen_bit):
    from kvserve.models.registry import build_model
    _, rounded, loaded = sixteen_bit
    ids = list(range(3, 43))
    ours = full_logits(build_model(loaded, torch.float32, "cpu", 512), ids)
    cast = full_logits(build_model(loaded, torch.float32, "cpu", 512, weight_dtype="float32"), ids)
    with torch.no_grad():
        ref = rounded(torch.tensor([ids])).logits[0]
    assert (ours - cast).abs().max().item() < 1e-5
    assert (ours - ref).abs().max().item() < 1e-4


def test_greedy_decode_equals_the_fp32_cast(sixteen_bit):
    """Through the engine (its fast path binds the few-row kernel), in small blocks: the same
    tokens and logits within 1e-5 as the same file cast to fp32, and transformers' tokens."""
    _, rounded, loaded = sixteen_bit
    prompts = [[(5 * i + j) % 120 + 3 for j in range(n)] for i, n in enumerate((9, 17))]
    runs = []
    for weight_dtype in ("auto", "float32"):
        engine = make_engine(loaded, dtype="float32", weight_dtype=weight_dtype, block_size=4, num_blocks=64)
        runs.append(run_collecting_logits(engine, prompts, greedy(12, ignore_eos=True)))
    (wide_outs, wide_logits), (cast_outs, cast_logits) = runs
    for prompt, a, b, la, lb in zip(prompts, wide_outs, cast_outs, wide_logits.values(), cast_logits.values()):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (torch.stack(la) - torch.stack(lb)).abs().max().item() < 1e-5
        with torch.no_grad():
            expected = rounded(torch.tensor([prompt + a.outputs[0].token_ids])).logits[0, len(prompt) - 1:-1]
        assert a.outputs[0].token_ids == expected.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", list(KINDS.values()))
def test_the_kernel_and_the_torch_path_give_the_same_products(dtype):
    """Without the compiled kernel (KVSERVE_KERNELS=off, a build missing) the weight is widened
    in torch: the same products, few rows and many, with a bias."""
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(67, 45, generator=g).to(dtype), torch.randn(67, generator=g)
    with_kernel, without = PackedLinear(keep_wide(w), bias), PackedLinear(keep_wide(w), bias)
    without.kernel = None
    for m in (1, 3, 8, 9, 32, 33, 40):  # the kernel up to WIDE_ROWS (32), then widen-then-GEMM
        x = torch.randn(m, 45, generator=g)
        cast = x @ w.float().T + bias
        for linear in (with_kernel, without):
            assert torch.allclose(linear(x), cast, rtol=1e-5, atol=1e-5)
        assert torch.allclose(with_kernel(x.view(1, m, 45)), cast.view(1, m, 67), rtol=1e-5, atol=1e-5)
