"""Suffix decoding through the engine and the scheduler: lossless at temperature 0 (token for token plain
decoding, chains and trees, several batches, no compiles after warm-up), and the scheduler keeps the suffix index
in step with the requests it runs (finished outputs kept, cancelled ones taken out)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.engine import compile_counter
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu, TreeEnvelope
from jaxspec.models.config import TINY
from jaxspec.policy.fixed import FixedPolicy
from jaxspec.scheduling.requests import FinishReason, Request
from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig
from jaxspec.speculation.proposers.suffix import SuffixProposer
from jaxspec.speculation.suffix_tree import SuffixConfig, SuffixIndex
from jaxspec.types import SamplingParams
from tests.conftest import random_prompts, reference_greedy

MENU = Menu(num_slots=4, max_len=128, batch_buckets=(1, 4), k_menu=(0, 2, 4, 6), window_buckets=(128,),
            prefill_buckets=(32,), tree_envelopes=(TreeEnvelope(6, 3),))
N_NEW = 20
PROMPT_LENGTHS = (5, 17, 9, 12)


@pytest.fixture(scope="module")
def engine(tiny_model):
    compile_counter.install()
    engine = Engine(tiny_model, SuffixProposer(SuffixIndex(SuffixConfig(depth=16, min_prob=0.0))), MENU)
    engine.warmup(progress=False)
    return engine


@pytest.fixture(scope="module")
def references(tiny_model):
    prompts = random_prompts(PROMPT_LENGTHS, TINY.vocab_size, seed=3)
    return prompts, [reference_greedy(tiny_model, p, N_NEW) for p in prompts]


def _twice_as_plain_decoding(sched, references, tag: str) -> tuple[int, int]:
    """Every prompt run twice through `sched` (the second round repeats the first: its outputs are in the global
    trie), each output asserted token for token plain decoding's; the second round's (accepted, proposed)."""
    prompts, expected = references
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    accepted = proposed = 0
    for round_ in range(2):
        reqs = [Request(f"{tag}-{round_}-{i}", p, params) for i, p in enumerate(prompts)]
        for result, want in zip(sched.generate_all(reqs), expected, strict=True):
            assert list(result.token_ids) == want, result.request_id
            if round_:
                accepted += sum(s.accepted for s in result.steps)
                proposed += sum(s.proposed for s in result.steps)
    return accepted, proposed


@pytest.mark.parametrize("k", [2, 4, 6])  # 6 runs the tree envelope 6:3
@pytest.mark.parametrize("running", [1, 4])
def test_greedy_equals_plain_decoding(engine, references, k, running):
    compiles = compile_counter.count()
    sched = Scheduler(engine, FixedPolicy(k), config=SchedulerConfig(max_running=running))
    accepted, proposed = _twice_as_plain_decoding(sched, references, f"k{k}-r{running}")
    assert compile_counter.count() == compiles  # host proposals are traced inputs: no new shapes
    assert proposed > 0 and accepted / proposed > 0.5  # repeats are proposed from earlier outputs, mostly accepted


@pytest.fixture(scope="module")
def chain_engine(tiny_model):
    """Chains only, proposed ahead: the scheduler overlaps its steps, proposing for the rows in flight."""
    engine = Engine(tiny_model, SuffixProposer(SuffixIndex(SuffixConfig(depth=16, min_prob=0.0, ahead=True))),
                    MENU.replace(tree_envelopes=()))
    engine.warmup(progress=False)
    return engine


class _Spy(FixedPolicy):
    """A fixed k that keeps the views it chose with and observed with."""

    def __init__(self, k):
        super().__init__(k)
        self.chosen, self.observed = [], []

    def choose(self, view):
        self.chosen.append(view)
        return super().choose(view)

    def observe(self, view, decision, result, elapsed_s):
        self.observed.append((view, result))


@pytest.mark.parametrize("running", [1, 4])
def test_the_overlapped_loop_proposes_ahead_and_keeps_plain_decoding(chain_engine, references, running):
    """Overlapped, a row in flight gets a chain proposed for the context its step is guessed to commit (its
    proposals accepted, the trie's next token as its bonus). Output: plain decoding's, token for token; on a
    repeat, most guesses hold and most proposals are accepted; the policy observes a row's chain only if the guess
    it was made on held."""
    index = chain_engine.suffix_index
    index.clear()
    compiles = compile_counter.count()
    policy = _Spy(4)
    sched = Scheduler(chain_engine, policy, config=SchedulerConfig(max_running=running))
    assert sched._overlap
    accepted, proposed = _twice_as_plain_decoding(sched, references, f"ahead-r{running}")
    assert compile_counter.count() == compiles
    assert proposed > 0 and accepted / proposed > 0.5
    ahead = sum(1 for v in policy.chosen for a in v.assumed_rates if a)
    assert ahead > 0  # rows in flight were proposed for
    assert all(v.assumed_rates == () for v, _ in policy.observed)
    # a row observed without its confidences (guess failed) verified proposals made for a context that never was
    dropped = sum(1 for v, r in policy.observed for i, rates in enumerate(v.proposal_rates)
                  if not rates and int(r.proposed[i]) > 0)
    kept = sum(1 for v, r in policy.observed for i, rates in enumerate(v.proposal_rates)
               if rates and int(r.proposed[i]) > 0)
    assert kept > dropped
    index.clear()


def test_wrong_proposals_change_nothing(engine, references):
    """Outputs of other prompts (mostly wrong continuations here) feed the trie: the output is unchanged."""
    prompts, expected = references
    sched = Scheduler(engine, FixedPolicy(4), config=SchedulerConfig(max_running=4))
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    # same prompt tails, other heads: matches lead into other requests' continuations
    mixed = [prompts[(i + 1) % 4][:3] + p[3:] for i, p in enumerate(prompts)]
    sched.generate_all([Request(f"m{i}", p, params) for i, p in enumerate(mixed)])
    results = sched.generate_all([Request(f"w{i}", p, params) for i, p in enumerate(prompts)])
    assert [list(r.token_ids) for r in results] == expected


def test_the_scheduler_feeds_and_cleans_the_index(tiny_model, references):
    prompts, _ = references
    index = SuffixIndex(SuffixConfig(depth=8, max_requests=2))
    engine = Engine(tiny_model, SuffixProposer(index), MENU.replace(tree_envelopes=(), k_menu=(0, 2)))
    engine.warmup(progress=False)
    sched = Scheduler(engine, FixedPolicy(2))
    assert not sched._overlap  # chains continue the tokens read unless proposed ahead (SuffixConfig.ahead)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    done = [sched.generate_all([Request(f"d{i}", p, params)])[0] for i, p in enumerate(prompts[:3])]  # in turn
    assert index.retained() == ("d1", "d2")  # two kept, the oldest evicted
    trie = index.output_trie()
    assert trie.sequence("d2") == tuple(done[2].token_ids)  # the committed output, first token included
    before = trie.nodes
    handle = sched.submit(Request("c", prompts[3], SamplingParams(max_tokens=60, ignore_eos=True)))
    for _ in range(4):
        sched.step_once()
    assert "c" in trie
    handle.cancel()
    while not handle.done():
        sched.step_once()
    assert handle.result().finish_reason == FinishReason.CANCELLED
    assert "c" not in trie and trie.nodes == before and index.nodes == before


def test_step_without_host_proposals_is_refused(engine):
    engine.prefill(0, [3, 4, 5], SamplingParams())
    with pytest.raises(ValueError, match="host_proposals"):
        engine.step([0], 2)
    engine.free(0)


def test_host_proposals_of_the_wrong_width_are_refused(engine):
    from jaxspec.types import HostProposals
    engine.prefill(0, [3, 4, 5], SamplingParams())
    short = HostProposals(token_ids=np.zeros((1, 1), np.int32), lens=np.ones((1,), np.int32),
                          parents=np.zeros((1, 1), np.int32), depth=np.zeros((1, 1), np.int32))
    with pytest.raises(ValueError, match="host proposals"):
        engine.step([0], 2, host_proposals=lambda k, tree: short)
    engine.free(0)


def test_engine_args_build_the_suffix_proposer(tiny_model):
    from jaxspec.engine.args import EngineArgs
    from jaxspec.engine.build import build_proposer

    args = EngineArgs(proposer="suffix", suffix_scope="tenant", suffix_requests=7, tree="4:2", suffix_ahead=True)
    proposer = build_proposer("suffix", tiny_model, suffix=args.suffix_config())
    assert proposer.index.config.ahead
    assert isinstance(proposer, SuffixProposer) and proposer.index.config.scope == "tenant"
    assert proposer.index.config.max_requests == 7
    with pytest.raises(ValueError, match="scope"):
        EngineArgs(proposer="suffix", suffix_scope="world")


def test_sampling_keeps_the_target_distribution(engine, tiny_model):
    """At temperature 1 (top-k 4) with suffix proposals (an earlier output of the same prompt, often rejected),
    the second token given the first follows the target: one Pearson test (tests/test_sampling_distribution.py's
    judge) over the groups of the first token, at α = 1e-3. Through the scheduler; every emitted position, with
    the power shown by broken verifies, is tests/test_suffix_distribution.py."""
    import jax
    from scipy.stats import chi2

    from tests.conftest import _jitted_forward
    from tests.test_sampling_distribution import _pearson

    prompt = [5, 9, 13, 9, 5, 2]
    index = engine.suffix_index
    index.clear()
    sched = Scheduler(engine, FixedPolicy(4), config=SchedulerConfig(max_running=4))
    sched.generate_all([Request("seed-output", prompt, SamplingParams(max_tokens=8, ignore_eos=True))])  # greedy
    n = 800
    params = [SamplingParams(temperature=1.0, top_k=4, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)]
    results = sched.generate_all([Request(f"t{s}", prompt, p) for s, p in enumerate(params)])
    index.clear()
    pairs = np.array([r.token_ids[:2] for r in results])  # [n, 2]
    assert sum(s.proposed for r in results for s in r.steps) > n / 2  # the step verified suffix proposals
    forward = _jitted_forward(tiny_model)
    v = TINY.vocab_size
    observed, probs = np.zeros((v, v)), np.zeros((v, v))
    for first in np.unique(pairs[:, 0]):
        padded = np.zeros((1, 128), np.int32)
        padded[0, :len(prompt) + 1] = prompt + [int(first)]
        logits = np.asarray(forward(padded)[0, len(prompt)])  # [V] after (prompt, x0)
        top = np.argsort(logits)[-4:]  # top-k 4, then temperature 1
        probs[first, top] = np.asarray(jax.nn.softmax(logits[top]))
        observed[first] = np.bincount(pairs[pairs[:, 0] == first, 1], minlength=v)
    stat, df, impossible = _pearson(observed, probs)
    assert df > 0 and impossible == 0
    assert chi2.sf(stat, df) > 1e-3
