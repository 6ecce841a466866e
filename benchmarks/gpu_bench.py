"""GPU benchmark without checkpoints: random weights of real configs, a proposer of controlled α.

    python -m benchmarks.gpu_bench --presets smollm2-135m,qwen2.5-1.5b,llama-7b-shaped --dtype bfloat16 \
        --alpha 0.8 --out $OUT/gpu_bench            (benchmarks/gpu_check.sh runs this)
    python -m benchmarks.gpu_bench --presets tiny --dtype float32 --quick --out artifacts/gpu_smoke   (CPU smoke)

For each preset: the target has random weights (seeded) in `--dtype`; the proposer is
NoisyProposer(α) over a draft model — `--draft self` (the target itself: acceptance exactly α at
T = 0) or `truncated:N` (its first N layers, cheaper, acceptance ≤ α). Prompts are the benchmark
workloads as byte ids folded into the vocabulary (no tokenizer), outputs `--max-tokens` long
(ignore_eos). Then the same open-loop sweep as `jaxspec bench` (jaxspec/bench/cli.py: service rate
measured, Poisson rates as fractions of it, policies none / fixed / goodput; with `--repeats R` goodput's ratio to
the best fixed k gets a 95 % paired interval, with `--slice S` the policies take turns). A preset that does
not fit the device memory is skipped with the error recorded. Writes gpu_bench.json (+ markdown
and figures per preset) into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from jaxspec.bench.cli import Settings, _floats, _ints, _strs, bench_max_len, check_goals, markdown_table, sweep


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", type=_strs, default=("smollm2-135m", "qwen2.5-1.5b", "llama-7b-shaped"))
    parser.add_argument("--dtype", default="bfloat16", help="model dtype (bfloat16 on GPU/TPU, float32 on CPU)")
    parser.add_argument("--alpha", type=float, default=0.8, help="acceptance of the noisy proposer")
    parser.add_argument("--draft", default="truncated:2", help="inner draft: self | truncated:N (default truncated:2)")
    parser.add_argument("--workloads", type=_strs, default=("chat", "summarization", "qa", "sql", "code"))
    parser.add_argument("--policies", type=_strs, default=("none", "fixed:1", "fixed:3", "fixed:5", "goodput"))
    parser.add_argument("--fractions", type=_floats, default=(0.2, 0.7, 1.3))
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--capacity", type=int, default=16)
    parser.add_argument("--k-menu", type=_ints, default=(0, 1, 2, 3, 4, 5))
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every cell with the same arrivals (paired): goodput's ratio to the best fixed k "
                             "gets a 95 %% interval (issue 46)")
    parser.add_argument("--slice", type=float, default=0.0, dest="slice_s",
                        help="a cell's policies run at once, taking turns of this many seconds (0: one after another)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke: 2 workloads, 2 rates, tiny sizes")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import jax

    from jaxspec.bench.common import machine
    from jaxspec.bench.plots import plot_records
    from jaxspec.engine import compile_counter
    from jaxspec.engine.build import build_draft
    from jaxspec.engine.engine import enable_compilation_cache
    from jaxspec.models.config import get_preset
    from jaxspec.models.llama import random_model
    from jaxspec.speculation.proposers.draft_model import DraftModelProposer
    from jaxspec.speculation.proposers.noisy import NoisyProposer

    enable_compilation_cache()
    compile_counter.install()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    q = args.quick
    settings = Settings(
        workloads=tuple(args.workloads[:2] if q else args.workloads), proposers=("noisy",),
        policies=tuple(args.policies),
        rates=None, fractions=tuple(args.fractions[::2] if q else args.fractions), closed_loop=None,
        requests=3 if q else args.requests, max_tokens=8 if q else args.max_tokens,
        max_prompt_tokens=min(args.max_prompt_tokens, 200) if q else args.max_prompt_tokens,
        capacity=2 if q else args.capacity, k_menu=(0, 1, 3) if q else args.k_menu,
        max_len=0, ignore_eos=True, seed=args.seed, quick=q, progress=not q, repeats=args.repeats,
        slice_s=args.slice_s)
    settings.max_len = bench_max_len(settings.max_prompt_tokens, settings.max_tokens, max(settings.k_menu))
    result = {"meta": {"command": " ".join(sys.argv), "machine": machine(), "devices": [str(d) for d in jax.devices()],
                       "dtype": args.dtype, "alpha": args.alpha, "draft": args.draft},
              "presets": {}}
    for name in args.presets:
        t0 = time.time()
        try:
            config = get_preset(name).replace(dtype=args.dtype)
            target = random_model(config, seed=args.seed)
            inner = DraftModelProposer(build_draft(args.draft, target))
            proposer = NoisyProposer(inner, args.alpha, config.vocab_size)

            def partial(records, name=name, t0=t0):
                result["presets"][name] = {"records": records, "partial": True, "wall_s": time.time() - t0}
                (out / "gpu_bench.json").write_text(json.dumps(result, indent=1), encoding="utf-8")

            records = sweep(target, None, {"noisy": proposer}, settings, draft_label=f"{args.draft},alpha={args.alpha}",
                            on_record=partial)
            for r in records:
                r["preset"] = name
            result["presets"][name] = {"records": records, "checks": check_goals(records), "wall_s": time.time() - t0,
                                       "params": config.num_params}
            (out / f"{name}.md").write_text(markdown_table(records), encoding="utf-8")
            plot_records(records, out, prefix=f"gpu_{name}")
            print(markdown_table(records))
        except Exception as exc:  # noqa: BLE001 - e.g. out of device memory: record it, go on
            traceback.print_exc()
            result["presets"][name] = {"error": repr(exc)[:2000], "wall_s": time.time() - t0}
        (out / "gpu_bench.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
        jax.clear_caches()
    print(f"wrote {out / 'gpu_bench.json'}", file=sys.stderr)
    return 0 if all("error" not in v for v in result["presets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
