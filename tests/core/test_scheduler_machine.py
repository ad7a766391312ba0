"""A Hypothesis state machine over the Scheduler: requests arrive (some sharing prefixes, some
with n > 1 samples, with priorities), are aborted, forked at any step, rolled back, given
proposed tokens that a random number of are accepted, and preempted by recompute, swap or either
(auto, by cost) in a pool far too small for them all, under every eviction policy. After every
rule the scheduler's and the pool's invariants hold; at the end every block is back."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.config import EVICTION_POLICIES
from kvserve.core.outputs import ModelRunnerOutput
from kvserve.core.request import RequestStatus
from tests.core.factories import HYBRID, make_request, make_scheduler

VOCAB = 5  # few distinct tokens: prompts and outputs collide, so prefix hits happen


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from(["recompute", "swap", "auto"]), policy=st.sampled_from(["fcfs", "priority"]),
                block_size=st.sampled_from([1, 2, 4]), budget=st.integers(3, 16), hybrid=st.booleans(),
                eviction=st.sampled_from(EVICTION_POLICIES))
    def setup(self, mode, policy, block_size, budget, hybrid, eviction):
        self.num_blocks = 48 // block_size * (2 if hybrid else 1)
        self.sched = make_scheduler(num_blocks=self.num_blocks, block_size=block_size, max_model_len=40,
                                    cpu_blocks=self.num_blocks if mode != "recompute" else 0, preemption_mode=mode,
                                    policy=policy, max_num_batched_tokens=budget, max_num_seqs=6,
                                    groups=HYBRID if hybrid else None, eviction_policy=eviction)
        self.num_added = 0

    def live(self, *statuses):
        return [r for r in self.sched.requests.values() if not statuses or r.status in statuses]

    @rule(family=st.integers(0, 2), length=st.integers(1, 12), max_tokens=st.integers(1, 10),
          priority=st.integers(0, 2), n=st.sampled_from([1, 1, 2]))
    def add(self, family, length, max_tokens, priority, n):
        prompt = [family] * 4 + [(family + i) % VOCAB for i in range(length)]
        req = make_request(prompt, max_tokens=max_tokens, priority=priority, n=n, rid=f"q{self.num_added}")
        self.num_added += 1
        self.sched.add_request(req)

    @precondition(lambda self: self.sched.groups)
    @rule(k=st.integers(0, 100))
    def abort(self, k):
        group_id = sorted(self.sched.groups)[k % len(self.sched.groups)]
        finished = self.sched.finish_group(group_id, RequestStatus.FINISHED_ABORTED)
        assert finished and all(r.is_finished for r in finished)
        assert group_id not in self.sched.groups

    @rule(data=st.data())
    def step(self, data):
        out = self.sched.schedule()
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        sampled, forked = {}, {}
        for s in out.scheduled:
            assert len(s.spec_token_ids) == 0 or s.num_samples == 1
            if not s.num_samples:
                continue
            accepted = data.draw(st.integers(0, len(s.spec_token_ids)))
            sampled[s.request_id] = s.spec_token_ids[:accepted] + [data.draw(st.integers(0, VOCAB - 1))]
            if s.num_samples > 1:
                forked[s.request_id] = [data.draw(st.integers(0, VOCAB - 1)) for _ in range(s.num_samples - 1)]
        self.sched.update(out, ModelRunnerOutput(sampled, forked_token_ids=forked))

    @precondition(lambda self: self.live(RequestStatus.RUNNING))
    @rule(k=st.integers(0, 100), tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4))
    def propose(self, k, tokens):
        running = self.live(RequestStatus.RUNNING)
        running[k % len(running)].spec_token_ids = tokens

    @precondition(lambda self: self.live(RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED))
    @rule(k=st.integers(0, 100), n=st.integers(1, 2))
    def fork(self, k, n):
        live = self.live(RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED)
        parent = live[k % len(live)]
        children = self.sched.fork(parent, n)
        for child in children:
            assert child.group is parent.group and child.all_token_ids == parent.all_token_ids
            assert child.num_computed_tokens == parent.num_computed_tokens
            assert self.sched.kv.block_table(child.request_id) == self.sched.kv.block_table(parent.request_id)

    @precondition(lambda self: any(r.num_computed_tokens for r in self.live(RequestStatus.RUNNING)))
    @rule(k=st.integers(0, 100), back=st.integers(0, 8), drop=st.integers(0, 3))
    def rollback(self, k, back, drop):
        candidates = [r for r in self.live(RequestStatus.RUNNING) if r.num_computed_tokens]
        req = candidates[k % len(candidates)]
        keep_outputs = max(req.num_output_tokens - drop, 0)
        num_tokens = req.num_prompt_tokens + keep_outputs
        target = min(max(req.num_computed_tokens - back, 0), num_tokens - 1)
        kept = self.sched.kv.holds_window_of(req, target)
        self.sched.rollback(req, target, keep_outputs)
        # back past what a sliding window gave back: the request starts again from its first token
        assert req.num_computed_tokens == (target if kept else 0) and req.num_output_tokens == keep_outputs

    @invariant()
    def integrity(self):
        if hasattr(self, "sched"):
            self.sched.check_integrity()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(200):  # let everything finish (or fail) normally, then abort the rest
            if not self.sched.has_unfinished():
                break
            out = self.sched.schedule()
            self.sched.update(out, ModelRunnerOutput(
                {s.request_id: [1] for s in out.scheduled if s.num_samples},
                forked_token_ids={s.request_id: [2] * (s.num_samples - 1) for s in out.scheduled if s.num_samples > 1}))
            self.sched.check_integrity()
        for group_id in list(self.sched.groups):
            self.sched.finish_group(group_id, RequestStatus.FINISHED_ABORTED)
        kv = self.sched.kv
        assert not self.sched.requests and not self.sched.groups
        assert kv.pool.num_free_blocks == self.num_blocks  # no block leaked
        assert kv.cpu_pool is None or kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_blocks
        kv.check_integrity()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
