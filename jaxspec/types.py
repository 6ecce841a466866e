"""Typed values passed between the engine's roles (no string-keyed dicts)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxspec.models.kv_cache import KVCache

MAX_LOGPROBS = 20  # the most top alternatives an engine returns per emitted token (OpenAI's top_logprobs limit)
MAX_TEMPERATURE = 100.0  # the largest temperature a request may ask for: beyond it the distribution over the
#                          tokens the top-k / top-p cut keeps is flat for any practical purpose, and logits
#                          divided by a temperature near float32's range collapse to equal values (or overflow)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (host side). temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no log-probabilities; N: each token's and its top N alternatives'

    def validate(self, max_tokens_limit: int | None = None) -> None:
        """Raise ValueError with a clear message if any value is out of range."""
        if not np.isfinite(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        # the device holds top_p as float32, where a tiny one becomes 0: valid, it keeps the top token
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_k >= 2**31:  # the device holds it as int32
            raise ValueError(f"top_k must be < 2^31, got {self.top_k}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise ValueError(f"max_tokens must be <= {max_tokens_limit}, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**31):
            raise ValueError(f"seed must be in [0, 2^31), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One emitted token under the target's raw distribution (log_softmax of its logits, no temperature or
    top-k / top-p warping): its log-probability and the `top` alternatives, (token id, log-probability),
    most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotParams:
    """Per-slot sampling parameters as traced device arrays, each [S+1]."""

    temperature: jax.Array  # float32
    top_p: jax.Array  # float32
    top_k: jax.Array  # int32, 0 = off
    seed: jax.Array  # int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowParams:
    """The same parameters gathered for the rows of one step, each [B]."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    keys: jax.Array  # [B] typed PRNG keys, fresh for this step of this request


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposals:
    """What a proposer guesses for one step.

    token_ids:   [B, k] proposed tokens (padding past `lens` is ignored).
    lens:        [B] int32, number of real proposals per row (≤ k).
    draft_probs: [B, k, V] q after the request's warping, or None for point-mass proposals
                 (prompt lookup): q(token_ids[b, i]) = 1.
    """

    token_ids: jax.Array
    lens: jax.Array
    draft_probs: jax.Array | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeProposals:
    """A token tree per row, inside a static envelope of k nodes at most Z deep (jaxspec/speculation/tree.py).

    token_ids: [B, k] int32 node tokens (padding past `lens` is ignored).
    parents:   [B, k] int32 parent of node n + 1 in the step's numbering: 0 is the root (the row's
               pending token), i ≥ 1 is node i. Nodes are topologically ordered: parents[b, n] ≤ n.
    depth:     [B, k] int32 depth of each node (1 = a child of the root), ≤ Z.
    lens:      [B] int32 real nodes per row: nodes 0 .. lens - 1 (a prefix closed under parents).
    draft_slots: [B, k] int32 or None: where a draft-model proposer wrote each node's own KV entry
               (draft cache position start + 1 + slot; -1: not written), for its `commit_tree`.
    Siblings carry distinct tokens. Point masses (no q): a proposer builds its tree deterministically
    from the context, which is what makes `verify.verify_tree` exact (see its docstring).
    """

    token_ids: jax.Array
    parents: jax.Array
    depth: jax.Array
    lens: jax.Array
    draft_slots: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostProposals:
    """Proposals made on the host (suffix decoding), passed into the step as traced inputs.

    token_ids: [B, k] int32 proposed tokens (chain) or node tokens (tree); padding past `lens` is ignored.
    lens:      [B] int32 real proposals (nodes) per row.
    parents:   [B, k] int32 a tree node's parent (0: the root, i ≥ 1: node i); zeros for a chain.
    depth:     [B, k] int32 a tree node's depth (≥ 1); zeros for a chain.
    """

    token_ids: jax.Array
    lens: jax.Array
    parents: jax.Array
    depth: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything on device between steps; donated into every step.

    cache:       target KV cache (lengths = committed tokens per slot).
    pending:     [S+1] the newest token of each slot, sampled but not yet in the cache.
    history:     [S+1, M] every token of each slot (prompt + generated); history[s, len[s]] = pending[s].
    n_generated: [S+1] tokens generated so far (the per-request PRNG counter).
    params:      per-slot sampling parameters.
    proposer:    the proposer's own state (e.g. the draft KV cache), or an empty tuple.
    """

    cache: KVCache
    pending: jax.Array
    history: jax.Array
    n_generated: jax.Array
    params: SlotParams
    proposer: object


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Host-side result of one speculative step for the B rows of the step.

    tokens:   [B, k+1] new tokens per row (accepted proposals then the bonus/resampled token).
    counts:   [B] how many of `tokens` are real (accepted + 1).
    proposed: [B] how many proposals each row verified.
    catch_up_calls / catch_up_tokens / catch_up_s: lazy draft catch-up run before this step (calls, their chunks'
      padded tokens, wall seconds); part of the step's wall time, but not of the step executable a cost model
      times.
    logprobs: [B, k+1] float32 log-probability of each of `tokens` under the target (engines with logprobs > 0,
      else None); top_logprobs / top_ids: [B, k+1, N] its N most likely alternatives, most likely first.
    """

    tokens: np.ndarray
    counts: np.ndarray
    proposed: np.ndarray
    catch_up_calls: int = 0
    catch_up_s: float = 0.0
    catch_up_tokens: int = 0
    logprobs: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None

    @property
    def accepted(self) -> np.ndarray:
        return self.counts - 1

    def row_tokens(self, row: int) -> list[int]:
        return [int(t) for t in self.tokens[row, : self.counts[row]]]

    def row_logprobs(self, row: int, n_top: int) -> list[TokenLogprobs]:
        """The log-probabilities of `row_tokens(row)` with their top `n_top` alternatives (ValueError when the
        engine returned none, or fewer alternatives)."""
        if self.logprobs is None:
            raise ValueError("this step returned no log-probabilities (the engine's logprobs option is 0)")
        return [token_logprobs(int(self.tokens[row, j]), self.logprobs[row, j], self.top_ids[row, j],
                               self.top_logprobs[row, j], n_top) for j in range(int(self.counts[row]))]


def token_logprobs(token_id: int, logprob, top_ids: np.ndarray, top_logprobs: np.ndarray,
                   n_top: int) -> TokenLogprobs:
    """A TokenLogprobs from an engine's arrays: top_ids / top_logprobs [N] (n_top ≤ N of them are kept)."""
    if n_top > len(top_ids):
        raise ValueError(f"{n_top} top alternatives asked, the engine returns {len(top_ids)}")
    return TokenLogprobs(token_id, float(logprob),
                         tuple((int(i), float(v)) for i, v in zip(top_ids[:n_top], top_logprobs[:n_top])))
