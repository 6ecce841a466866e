"""One layer's cached attention on XLA:CPU: the in-place kernel against the XLA form, per (T, W, context).

    python -m benchmarks.cache_attention --out docs/results/cache_attention.json

For each T (new tokens per row), window bucket W and filled context length, both forms attend one layer's
queries over the same cache (SmolLM2-135M's heads by default: N = 9, G = 3, H = 64; `--heads 12,2,128` for
Qwen2.5-1.5B's), jitted, called alternately (medians). The XLA form is `jaxspec.models.llama.attention` over the
window gathered from the cache (what `forward_cached` runs where the kernel does not apply); the kernel is
`jaxspec.models.cache_attention.cache_attention`. The machine load is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.common import machine
from jaxspec.bench.floor import interleaved_medians, load
from jaxspec.models.cache_attention import cache_attention
from jaxspec.models.llama import attention


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=_ints, default=(9, 3, 64), help="N,G,H (query heads, kv heads, head dim)")
    parser.add_argument("--tokens", type=_ints, default=(1, 5, 9, 33, 64, 128), help="T values")
    parser.add_argument("--windows", type=_ints, default=(128, 512, 2048))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("docs/results/cache_attention.json"))
    args = parser.parse_args(argv)
    n, g, h = args.heads
    b, slots, m = args.batch, args.batch + 1, max(args.windows)
    rng = np.random.default_rng(0)
    # cache_k, cache_v: [S+1, M, G, H]; rows use slots 0 .. B-1
    cache_k = jnp.asarray(rng.standard_normal((slots, m, g, h), np.float32))
    cache_v = jnp.asarray(rng.standard_normal((slots, m, g, h), np.float32))
    slot_ids = jnp.arange(b, dtype=jnp.int32)
    kernel = jax.jit(cache_attention)
    xla_form = jax.jit(lambda q, k, v, s, mask: attention(q, k[s, :mask.shape[2]], v[s, :mask.shape[2]], mask))
    rows, before = [], load()
    for t in args.tokens:
        for w in args.windows:
            for context in sorted({w // 8, w - t}):  # a short context in a large bucket, and a full window
                if context < t:
                    continue
                q = jnp.asarray(rng.standard_normal((b, t, n, h), np.float32))  # [B, T, N, H]
                start = context - t  # the T new tokens sit at positions start .. context - 1, causally
                mask = jnp.asarray(np.broadcast_to(np.arange(w)[None, None, :]
                                                   <= start + np.arange(t)[None, :, None], (b, t, w)))  # [B, T, W]
                call_args = (q, cache_k, cache_v, slot_ids, mask)
                kernel_s, xla_s = interleaved_medians(
                    [lambda: kernel(*call_args).block_until_ready(), lambda: xla_form(*call_args).block_until_ready()],
                    args.repeats)
                rows.append({"T": t, "W": w, "context": context, "kernel_ms": kernel_s * 1e3,
                             "xla_form_ms": xla_s * 1e3, "xla_form_over_kernel": xla_s / kernel_s})
                print(f"T={t:>4} W={w:>5} context={context:>5}  kernel {kernel_s * 1e3:7.3f} ms  "
                      f"XLA form {xla_s * 1e3:7.3f} ms  ({xla_s / kernel_s:.2f}x)", flush=True)
    result = {"command": "python -m benchmarks.cache_attention " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "heads": {"N": n, "G": g, "H": h}, "batch": b,
              "load_before": before, "load_after": load(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}; {result['load_before']} -> {result['load_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
