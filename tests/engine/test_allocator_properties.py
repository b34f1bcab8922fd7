"""Hypothesis: random add/step/abort sequences never leak or double-own a KV block."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.invariants import check_pool_invariants


@pytest.fixture(scope="module")
def shared_loaded(tiny_llama_dir):
    from engine.setup import load_model

    return load_model(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=24, block_size=4))


def _machine(loaded, prefix_caching: bool):
    class EngineMachine(RuleBasedStateMachine):
        @initialize()
        def make(self):
            for k, v in loaded.kv_caches:
                k.zero_(), v.zero_()
            cfg = EngineConfig(num_kv_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=6,
                               enable_prefix_caching=prefix_caching)
            self.engine = LLMEngine(cfg, loaded=loaded)
            self.next_id = 0

        @rule(length=st.integers(1, 30), max_tokens=st.integers(1, 20), ns=st.sampled_from([b"a", b"b"]),
              shared=st.booleans(), n=st.integers(1, 2))
        def add(self, length, max_tokens, ns, shared, n):
            base = [5] * 12 if shared else []
            prompt = (base + [100 + self.next_id * 31 + i for i in range(length)])[:30]
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
            self.engine.add_request(prompt, params, f"r{self.next_id}", cache_namespace=ns)
            self.next_id += 1

        @rule(k=st.integers(1, 3))
        def step(self, k):
            for _ in range(k):
                self.engine.step()

        @rule(data=st.data())
        def abort(self, data):
            if self.engine.requests:
                self.engine.abort(data.draw(st.sampled_from(sorted(self.engine.requests))))

        @invariant()
        def pool_consistent(self):
            if hasattr(self, "engine"):
                check_pool_invariants(self.engine)

        def teardown(self):
            if hasattr(self, "engine"):
                while self.engine.has_unfinished():
                    self.engine.step()
                    check_pool_invariants(self.engine)
                assert self.engine.kv.pool.num_used_blocks == 0, "blocks leaked after all requests ended"

    return EngineMachine


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_random_add_step_abort_never_leaks(shared_loaded, prefix_caching):
    machine = _machine(shared_loaded, prefix_caching)
    machine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                         suppress_health_check=list(HealthCheck))
    machine.TestCase().runTest()
