"""The XLA:CPU attention kernel over a paged cache against its per-slot call, per (B, T, W) and page size.

    python -m benchmarks.paged_attention --out docs/results/paged/attention.json

For each batch B, new tokens per row T and window W (full: the rows' contexts fill the window), one layer's
queries (SmolLM2-135M's heads by default: N = 9, G = 3, H = 64) attend:
- `per-slot`: `cache_attention` over a per-slot cache [B+1, max W, G, H] (slot ids; one page of M a slot);
- `paged P`: `paged_cache_attention` over a pool [Np, P, G, H] whose pages are handed out shuffled (rows'
  pages scattered over the pool, as a page allocator leaves them), through a block table [B, W/P];
- `old per-slot` (with `--old-kernel PATH`): the per-slot call of a kernel built before paging (its .so),
  registered under its own target name, to show what the paged generalisation costs the per-slot call.
All forms are jitted, each over its own buffers (none finds another's data in the caches), and called
alternately, in a shuffled order each repeat; the machine load is recorded before and after.
Ratios are the paged (or old) median over the per-slot median, and the same of the fastest runs (minima: on a
loaded shared host the least disturbed run of each form, what the kernel itself costs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.common import machine
from jaxspec.bench.floor import load
from jaxspec.models.cache_attention import cache_attention, paged_cache_attention

OLD_TARGET = "jaxspec_cache_attention_before_paging"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _old_kernel(path: Path):
    """The per-slot call of a kernel .so built before paging (q, cache_k, cache_v, slot_ids [B], mask)."""
    spec = importlib.util.spec_from_file_location("_cache_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    jax.ffi.register_ffi_target(OLD_TARGET, module.handler(), platform="cpu")

    def call(q, cache_k, cache_v, slot_ids, mask):
        return jax.ffi.ffi_call(OLD_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))(q, cache_k, cache_v, slot_ids,
                                                                                     mask)
    return call


def _interleaved_times(calls: dict, repeats: int, rng: np.random.Generator) -> dict[str, list[float]]:
    """Seconds of each call per repeat, the calls alternated in a shuffled order each repeat (after one untimed
    run each)."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name in rng.permutation(list(calls)):
            call = calls[name]
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=_ints, default=(9, 3, 64), help="N,G,H (query heads, kv heads, head dim)")
    parser.add_argument("--batches", type=_ints, default=(1, 8))
    parser.add_argument("--tokens", type=_ints, default=(1, 9), help="T values")
    parser.add_argument("--windows", type=_ints, default=(256, 1024))
    parser.add_argument("--page-sizes", type=_ints, default=(8, 16, 32))
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--old-kernel", type=Path, default=None, help="a _cache_attention .so built before paging")
    parser.add_argument("--out", type=Path, default=Path("docs/results/paged/attention.json"))
    args = parser.parse_args(argv)
    n, g, h = args.heads
    rng = np.random.default_rng(0)
    old_kernel = jax.jit(_old_kernel(args.old_kernel)) if args.old_kernel else None
    paged = jax.jit(paged_cache_attention)
    rows, before = [], load()
    for b in args.batches:
        m = max(args.windows)
        # cache_k, cache_v: [B+1, M, G, H]; rows use slots 0 .. B-1
        cache = lambda: jnp.asarray(rng.standard_normal((b + 1, m, g, h), np.float32))  # noqa: E731
        forms = {"per-slot": (jax.jit(cache_attention), cache(), cache())}
        if old_kernel:
            forms["old per-slot"] = (old_kernel, cache(), cache())
        slot_ids = jnp.arange(b, dtype=jnp.int32)
        pools = {}
        for p in args.page_sizes:
            num_pages = 1 + b * (m // p)  # page 0 scratch, then every row's pages
            # k_pages, v_pages: [Np, P, G, H]; table: [B, M/P] of shuffled page ids 1..Np-1
            k_pages = jnp.asarray(rng.standard_normal((num_pages, p, g, h), np.float32))
            v_pages = jnp.asarray(rng.standard_normal((num_pages, p, g, h), np.float32))
            table = rng.permutation(np.arange(1, num_pages)).reshape(b, m // p).astype(np.int32)
            pools[p] = (k_pages, v_pages, table)
        for t in args.tokens:
            for w in args.windows:
                q = jnp.asarray(rng.standard_normal((b, t, n, h), np.float32))  # [B, T, N, H]
                start = w - t  # the T new tokens at positions W-T .. W-1, causally: the window is full
                mask = jnp.asarray(np.broadcast_to(np.arange(w)[None, None, :]
                                                   <= start + np.arange(t)[None, :, None], (b, t, w)))  # [B, T, W]
                calls = {name: (lambda f=f, ck=ck, cv=cv: f(q, ck, cv, slot_ids, mask).block_until_ready())
                         for name, (f, ck, cv) in forms.items()}
                for p, (k_pages, v_pages, table) in pools.items():
                    if w % p:
                        continue
                    window_table = jnp.asarray(table[:, :w // p])  # [B, W/P]
                    calls[f"paged P={p}"] = (lambda k=k_pages, v=v_pages, tb=window_table:
                                             paged(q, k, v, tb, mask).block_until_ready())
                times = _interleaved_times(calls, args.repeats, rng)
                medians = {name: statistics.median(runs) for name, runs in times.items()}
                minima = {name: min(runs) for name, runs in times.items()}
                row = {"B": b, "T": t, "W": w,
                       "median_ms": {name: s * 1e3 for name, s in medians.items()},
                       "min_ms": {name: s * 1e3 for name, s in minima.items()},
                       "median_over_per_slot": {name: s / medians["per-slot"] for name, s in medians.items()
                                                if name != "per-slot"},
                       "min_over_per_slot": {name: s / minima["per-slot"] for name, s in minima.items()
                                             if name != "per-slot"}}
                rows.append(row)
                print(f"B={b} T={t} W={w:>5}  median ms " + " ".join(f"{k} {s * 1e3:.3f}" for k, s in medians.items())
                      + "  | over per-slot: median " + " ".join(f"{k} {r:.2f}" for k, r in
                                                               row["median_over_per_slot"].items())
                      + "; min " + " ".join(f"{k} {r:.2f}" for k, r in row["min_over_per_slot"].items()), flush=True)
    result = {"command": "python -m benchmarks.paged_attention " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "heads": {"N": n, "G": g, "H": h}, "repeats": args.repeats,
              "load_before": before, "load_after": load(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}; {result['load_before']} -> {result['load_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
