"""`jaxspec profile`: time every compiled step shape (B, k, W) of an engine's menu on this device.

For each attention window W and k (one representative context: the middle of those whose step at k
lands in W), each batch bucket B and each k:
prefill B dummy slots, run one untimed step, then `repeats` timed steps, and keep the median
seconds. Slots are re-prefilled whenever growth would move a step into another window.
Real-token probe: for each B ≥ 2 at the largest k, alternate the step with every row at k and
with every row but the first capped at 0 (row_k = [k, 0, ...]: the same executable, since a
step runs at the smallest menu k ≥ its largest row cap), d_j = T_full − T_capped per pair;
c_B = median_j d_j / ((B−1)·k) if at least 3/4 of the d_j > 0 (a consistent saving), else 0 (a
padded executable costs the same either way and timing noise must not invent a per-token price);
c_real = median_B c_B seconds per verified token (0 with no B ≥ 2; see policy/cost_model.py).
Every timed step is checked to run at the shape it is recorded under (`Menu.step_shape`, the function
the engine runs steps with). `warmup()` runs first, so nothing compiles while timing. Profiling
uses slots 0..max(B)−1 with dummy prompts and frees them at the end: run it before requests are
admitted (at start-up), never on a serving engine.

Library use: `profile_engine(engine, ...) -> CostProfile`; the server loads a matching profile
(`cost_model.load_matching_profile(profile_key(engine))`) or calls this during warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
from tqdm import tqdm

from jaxspec.engine.api import prefill_prompt
from jaxspec.menu import CapacityError
from jaxspec.policy.cost_model import CostEntry, CostProfile, ProfileKey
from jaxspec.types import HostProposals

PROBE_PAIRS = 8  # minimum full/capped pairs per batch bucket in the real-token probe
SIGNIFICANT_SHARE = 0.75  # share of pairs that must show a saving for c_real to count


def default_contexts(window_buckets: Sequence[int], k: int = 0) -> tuple[int, ...]:
    """One context per window: the middle of those whose step at this k lands in it. A step at
    context n needs n + k + 1 cache positions, so window W takes contexts previous window − k …
    W − k − 1 (1 … for the first). The middle, because the cached-attention kernel's cost follows the
    context (the XLA form's depends on W alone; docs/design.md, "Attention on XLA:CPU")."""
    lows = [1] + [max(1, prev - k) for prev in window_buckets[:-1]]
    return tuple((lo + max(lo, w - k - 1)) // 2 for lo, w in zip(lows, window_buckets, strict=True))


def device_kind() -> str:
    import jax  # lazy: `jaxspec profile --help` should not start a backend

    return jax.devices()[0].device_kind


def profile_key(engine, kind: str | None = None) -> ProfileKey:
    """The key a profile of this engine is saved and looked up under."""
    c = engine.menu
    # a tree envelope runs at its k in place of the chain there: a profile of one is not the other's
    trees = "".join(f"+tree{t}" for t in c.tree_envelopes)
    return ProfileKey(device_kind=kind or device_kind(), model=engine.model_name, draft=engine.proposer_name + trees,
                      batch_buckets=c.batch_buckets, k_menu=c.k_menu, window_buckets=c.window_buckets,
                      dtype=engine.dtype, mesh=str(engine.mesh_spec), attention=engine.kernels.attention)


def profile_engine(engine, contexts: Sequence[int] | None = None, repeats: int = 5, progress: bool = True, *,
                   real_token_probe: bool = True, clock: Callable[[], float] = time.perf_counter,
                   wall_clock: Callable[[], float] = time.time, kind: str | None = None) -> CostProfile:
    """Median step seconds of every (B, k, W) reached by `contexts` (default: one per window)."""
    from jaxspec.types import SamplingParams

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    c = engine.menu
    if contexts is not None:
        for ctx in contexts:
            if not 1 <= ctx <= c.max_len - c.k_menu[-1] - 1:
                raise ValueError(f"context {ctx} outside [1, max_len − max k − 1 = {c.max_len - c.k_menu[-1] - 1}]")
        contexts_at = {k: tuple(contexts) for k in c.k_menu}
    else:  # per k, so every (k, W) of the menu is reached even when windows are close together
        contexts_at = {k: default_contexts(c.window_buckets, k) for k in c.k_menu}
    # every row of the largest batch holds the longest context: its own pages (shared ones would read warm)
    longest = max(ctx + k + 1 for k, cs in contexts_at.items() for ctx in cs)
    needed = c.batch_buckets[-1] * c.pages_for(longest)
    if needed > c.pool_pages - 1:
        raise ValueError(f"profiling holds {c.batch_buckets[-1]} rows of up to {longest} positions: {needed} KV pages, "
                         f"but the pool has {c.pool_pages - 1}; profile once with the default pool (a step's cost "
                         f"does not depend on the pool's size, and the profile is found again without --num-pages)")
    engine.warmup(progress=progress)

    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=c.max_len)
    slots = list(range(c.batch_buckets[-1]))

    def prompt(ctx: int) -> list[int]:
        # a short repeating pattern: prompt lookup finds continuations, like in real text
        return [int(2 + (i % 7) % max(1, vocab - 2)) for i in range(ctx)]

    def shape_of(rows: list[int], k: int, row_k: list[int] | None):
        return c.step_shape([engine.length(r) for r in rows], row_k, k)

    def ensure_window(rows: list[int], k: int, window: int, ctx: int, row_k: list[int] | None) -> None:
        try:
            moved = shape_of(rows, k, row_k).window != window
        except CapacityError:  # growth overran the largest window
            moved = True
        if moved:
            for s in rows:
                prefill_prompt(engine, s, prompt(ctx), params, seed=0)

    def timed(rows: list[int], k: int, window: int, ctx: int, row_k: list[int] | None) -> float:
        ensure_window(rows, k, window, ctx, row_k)
        shape = shape_of(rows, k, row_k)
        if (shape.k, shape.window) != (k, window):
            raise RuntimeError(f"profiling (k={k}, W={window}) would run the step at (k={shape.k}, "
                               f"W={shape.window})")
        extra = {}
        if getattr(engine, "suffix_index", None) is not None:  # host proposals: full ones, the shape's cost
            extra["host_proposals"] = lambda k_run, tree: filler_proposals(len(rows), k_run)
        t0 = clock()
        engine.step(rows, k, row_k, **extra)
        return clock() - t0

    def time_steps(rows: list[int], k: int, window: int, ctx: int) -> float:
        timed(rows, k, window, ctx, None)  # untimed first run
        return statistics.median(timed(rows, k, window, ctx, None) for _ in range(repeats))

    plan = []  # (ctx, B, k, W), each shape once, grouped by context (fewer re-prefills)
    seen = set()
    for ctx in sorted({ctx for cs in contexts_at.values() for ctx in cs}):
        for b in c.batch_buckets:
            for k in c.k_menu:
                if ctx not in contexts_at[k]:
                    continue
                w = c.step_shape([ctx], None, k).window
                if (b, k, w) not in seen:
                    seen.add((b, k, w))
                    plan.append((ctx, b, k, w))

    entries: dict[tuple[int, int, int], CostEntry] = {}
    prefilled_ctx = None
    for ctx, b, k, w in tqdm(plan, desc="profiling steps", unit="shape", disable=not progress, leave=False):
        if ctx != prefilled_ctx:
            for s in slots:
                prefill_prompt(engine, s, prompt(ctx), params, seed=0)
            prefilled_ctx = ctx
        entries[(b, k, w)] = CostEntry(b, k, w, time_steps(slots[:b], k, w, ctx), repeats)

    real_token_s = 0.0
    k_top = c.k_menu[-1]
    probed = [b for b in c.batch_buckets if b >= 2]  # one row keeps k_top, so the executable stays
    if real_token_probe and k_top > 0 and probed:
        per_token = []
        ctx = contexts_at[k_top][0]
        w = c.step_shape([ctx], None, k_top).window
        pairs = max(repeats, PROBE_PAIRS)
        for b in tqdm(probed, desc="probing real-token cost", disable=not progress, leave=False):
            rows, capped = slots[:b], [k_top] + [0] * (b - 1)
            timed(rows, k_top, w, ctx, capped)  # untimed first run
            # alternate full and capped steps so drift hits both alike; d_j = T_full − T_capped
            diffs = [timed(rows, k_top, w, ctx, None) - timed(rows, k_top, w, ctx, capped) for _ in range(pairs)]
            significant = sum(d > 0 for d in diffs) >= SIGNIFICANT_SHARE * len(diffs)
            per_token.append(statistics.median(diffs) / ((b - 1) * k_top) if significant else 0.0)
        real_token_s = statistics.median(per_token)

    for s in slots:  # free the slots the dummy prompts used
        engine.free(s)
    return CostProfile(key=profile_key(engine, kind), entries=tuple(entries.values()),
                       real_token_s=real_token_s, created_unix=wall_clock())


# --- `jaxspec profile` --------------------------------------------------------------------------


def filler_proposals(n: int, k: int) -> HostProposals:
    """n rows of k host proposals that fit any chain and any tree envelope at k (distinct children of the root):
    what a step costs does not depend on which tokens it verifies."""
    tokens = np.tile(np.arange(k, dtype=np.int32), (n, 1))  # [n, k]
    return HostProposals(token_ids=tokens, lens=np.full((n,), k, np.int32), parents=np.zeros_like(tokens),
                         depth=np.ones_like(tokens))
