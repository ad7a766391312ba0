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
    with StepBreakdown(engine.model) as b:
        for _ in range(8):
            engine.step()
    assert RMSNorm.forward is original
    parts = b.per_step_ms(8)
    assert all(parts[k] > 0 for k in ("matmul", "attention", "norms", "rope", "sampling", "schedule", "step"))
    assert abs(sum(v for k, v in parts.items() if k != "step") - parts["step"]) < 1e-6
    assert parts["other"] >= 0


def test_a_bound_model_is_timed_through_its_fast_forms(stories):
    """Packed weights: the bound attention and MLP blocks call their children's forward at each
    call, so the timers wrapped around the products and the attention layers see them."""
    engine = make_engine(stories, weight_dtype="int8")
    engine.add_request(None, [1, 2, 3], greedy(40))
    engine.step()
    with StepBreakdown(engine.model) as b:
        for _ in range(8):
            engine.step()
    parts = b.per_step_ms(8)
    assert parts["matmul"] > 0 and parts["attention"] > 0 and parts["norms"] > 0
    assert not any("forward" in m.__dict__ and getattr(m.__dict__["forward"], "__name__", "") == "timed"
                   for m in engine.model.modules())  # the wrapped methods are put back
