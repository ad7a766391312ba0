"""The step breakdown adds up: its parts and "other" make the step, each part is its own time,
and the methods it timed are put back."""

from kvserve.bench.breakdown import StepBreakdown
from kvserve.models.llama import RMSNorm
from tests.conftest import greedy, make_engine


def test_parts_add_up_to_the_step_and_the_methods_come_back(stories):
    engine = make_engine(stories)
    engine.add_request(None, [1, 2, 3], greedy(40))
    engine.step()
    original = RMSNorm.forward
    with StepBreakdown(engine) as b:
        for _ in range(8):
            engine.step()
    assert RMSNorm.forward is original
    parts = b.per_step_ms(8)
    assert all(parts[k] > 0 for k in ("matmul", "attention", "norms", "rope", "sampling", "schedule", "step"))
    assert abs(sum(v for k, v in parts.items() if k != "step") - parts["step"]) < 1e-6
    assert parts["other"] >= 0


def test_a_bound_model_is_timed_through_its_fast_forms(stories):
    """Packed weights: the bound blocks call their products' kernels themselves, so the kernels'
    functions are timed (the fast path bound again to take them): every product of every layer
    counts as matmul, and the kernels and methods come back afterwards."""
    from kvserve import kernels
    engine = make_engine(stories, weight_dtype="int8")
    engine.add_request(None, [1, 2, 3], greedy(40))
    engine.step()
    product = kernels.load("linear_quant").linear_quant if kernels.load("linear_quant") is not None else None
    with StepBreakdown(engine) as b:
        for _ in range(8):
            engine.step()
    parts = b.per_step_ms(8)
    assert parts["matmul"] > 0 and parts["attention"] > 0 and parts["norms"] > 0
    if engine.runner.fast_path.get("model.layers.0.self_attn"):
        layers = engine.model.config.num_hidden_layers
        assert b.calls["matmul"] >= 8 * (4 * layers + 1)  # q|k|v, o, gate|up, down a layer, and the head
    assert not any("forward" in m.__dict__ and getattr(m.__dict__["forward"], "__name__", "") == "timed"
                   for m in engine.model.modules())  # the wrapped methods are put back
    if product is not None:
        assert kernels.load("linear_quant").linear_quant is product
