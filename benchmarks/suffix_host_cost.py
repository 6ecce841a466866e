"""Suffix decoding's host work per step, at realistic trie sizes (no model, no device: the tries alone).

    python -m benchmarks.suffix_host_cost --out docs/results/suffix/host_cost.json

What the scheduler does on the host for suffix decoding, timed here with the same calls on real token streams:

    propose   per step, each running row's chain (`SuffixIndex.propose` at the menu's largest k: the scheduler's
              `_view`, before the policy chooses)
    tree      per step, each row's token tree for an envelope (`host_proposals` with a tree: a tree step)
    extend    per step, each row's committed tokens (1 + accepted) into its scope's trie
    start     per request, its prompt's trie (admission)
    finish    per request, its output kept and the oldest evicted past the bounds (the trie at its bound)

The global trie is first filled with earlier outputs up to `--fill` tokens (the default bounds keep 65,536),
then `--batch` live requests decode for `--steps` steps each. Token streams are the tokenizer's ids of the
agentic, chat and edit workloads' texts (SmolLM2's tokenizer; earlier outputs and live outputs are those texts,
so matches and branching are those of real text). Each step's row commits 1 to 1 + k tokens of its stream, as
many as the chain proposed correctly plus one (the acceptance that greedy verification would give if the stream
were the model's output). Times are per step (over all B rows) in microseconds: mean, p50, p99. The trie's
memory is measured once (tracemalloc) at the largest fill. Record the load with the result (it is saved).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from jaxspec.bench.common import machine
from jaxspec.bench.workloads import load_workload
from jaxspec.menu import TreeEnvelope
from jaxspec.speculation.proposers.suffix import host_proposals
from jaxspec.speculation.suffix_tree import SuffixConfig, SuffixIndex


def token_streams(n: int, max_tokens: int) -> list[list[int]]:
    """n real token streams (≤ max_tokens each): agentic, chat and edit texts in turn, SmolLM2's tokenizer."""
    from jaxspec.models.loading.registry import resolve_model
    from jaxspec.models.loading.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_gguf(resolve_model(None).path)
    per = -(-n // 3)
    streams = []
    for name in ("agentic", "chat", "edit"):
        workload = load_workload(name, tokenizer, per, max_prompt_tokens=max_tokens)
        streams += [list(p) for p in workload.prompts]
    order = np.random.default_rng(0).permutation(len(streams))  # [n'] the three workloads mixed
    return [streams[i] for i in order[:n]]


def fill(index: SuffixIndex, streams: list[list[int]], tokens: int) -> int:
    """Earlier requests' outputs (whole streams, cycled) into the global trie until it holds `tokens`, or until
    its bounds evict (it is then full). -> the requests fed."""
    r = 0
    while index.output_trie() is None or index.output_trie().tokens < tokens:
        stream = streams[r % len(streams)]
        index.start(("earlier", r), stream[:8])
        index.extend(("earlier", r), stream)
        index.finish(("earlier", r), keep=True)
        r += 1
        if len(index.retained()) < r:  # the oldest went: at the bound
            break
    return r


def summary(times_s: list[float]) -> dict:
    us = np.asarray(times_s) * 1e6
    return {"mean_us": float(us.mean()), "p50_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99)),
            "n": len(us)}


def run_case(streams, config: SuffixConfig, fill_tokens: int, batch: int, steps: int, k: int,
             envelope: TreeEnvelope) -> dict:
    index = SuffixIndex(config)
    earlier = fill(index, streams, fill_tokens) if fill_tokens else 0
    trie = index.output_trie()
    rng = np.random.default_rng(batch)
    times = {name: [] for name in ("propose", "tree", "extend", "start", "finish")}
    proposed = accepted = 0
    request = 0
    live: dict[tuple, tuple[list[int], int]] = {}  # request -> (its output stream, position)

    def admit():
        nonlocal request
        prompt = streams[int(rng.integers(len(streams)))][:256]
        output = streams[int(rng.integers(len(streams)))]
        rid = ("live", request)
        request += 1
        started = time.perf_counter()
        index.start(rid, prompt)
        index.extend(rid, output[:1])  # the first token, from the prefill
        times["start"].append(time.perf_counter() - started)
        live[rid] = (output, 1)

    for _ in range(batch):
        admit()
    for _ in range(steps):
        rows = list(live)
        started = time.perf_counter()
        chains = [index.propose(rid, k) for rid in rows]
        times["propose"].append(time.perf_counter() - started)
        started = time.perf_counter()
        host_proposals(index, rows, envelope.nodes, envelope)
        times["tree"].append(time.perf_counter() - started)
        commits = []
        for rid, chain in zip(rows, chains):
            output, at = live[rid]
            right = 0
            while right < len(chain.tokens) and at + right < len(output) and chain.tokens[right] == output[at + right]:
                right += 1
            proposed, accepted = proposed + len(chain.tokens), accepted + right
            commits.append((rid, output[at: at + right + 1]))
            live[rid] = (output, at + right + 1)
        started = time.perf_counter()
        for rid, tokens in commits:
            index.extend(rid, tokens)
        times["extend"].append(time.perf_counter() - started)
        for rid in rows:  # a finished stream leaves (its output kept, the oldest evicted), a new request comes
            output, at = live[rid]
            if at >= len(output):
                started = time.perf_counter()
                index.finish(rid, keep=True)
                times["finish"].append(time.perf_counter() - started)
                del live[rid]
                admit()
    trie = index.output_trie()
    return {"fill_tokens": fill_tokens, "batch": batch, "steps": steps, "k": k, "tree": f"{envelope.nodes}:"
            f"{envelope.depth}", "earlier_requests": earlier, "trie_tokens": trie.tokens if trie else 0,
            "trie_nodes": trie.nodes if trie else 0, "acceptance": accepted / max(proposed, 1),
            **{name: summary(t) for name, t in times.items() if t}}


def trie_memory(streams, config: SuffixConfig, fill_tokens: int) -> dict:
    """Bytes the global trie holds at `fill_tokens` tokens (tracemalloc, Python objects included)."""
    tracemalloc.start()
    index = SuffixIndex(config)
    fill(index, streams, fill_tokens)
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    trie = index.output_trie()
    return {"fill_tokens": fill_tokens, "trie_tokens": trie.tokens, "trie_nodes": trie.nodes, "bytes": current,
            "bytes_per_node": current / trie.nodes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fill", default="0,4096,16384,65536", help="global trie sizes in tokens")
    parser.add_argument("--batch", default="1,4,8", help="running requests per step")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--k", type=int, default=4, help="the menu's largest k (chain length)")
    parser.add_argument("--tree", default="8:4", help="tree envelope N:D")
    parser.add_argument("--depth", type=int, default=SuffixConfig.depth)
    parser.add_argument("--out", default="docs/results/suffix/host_cost.json")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    config = SuffixConfig(depth=args.depth)
    nodes, depth = (int(x) for x in args.tree.split(":"))
    envelope = TreeEnvelope(nodes, depth)
    streams = token_streams(384, 256)
    fills = [int(x) for x in args.fill.split(",")]
    cases = []
    for fill_tokens in fills:
        for batch in (int(x) for x in args.batch.split(",")):
            case = run_case(streams, config, fill_tokens, batch, args.steps, args.k, envelope)
            cases.append(case)
            print(f"fill {fill_tokens:6d} B {batch}: propose {case['propose']['mean_us']:8.0f} us, tree "
                  f"{case['tree']['mean_us']:8.0f} us, extend {case['extend']['mean_us']:6.0f} us per step; "
                  f"finish {case.get('finish', {}).get('mean_us', float('nan')):8.0f} us; nodes "
                  f"{case['trie_nodes']}", flush=True)
    memory = trie_memory(streams, config, max(fills))
    result = {"meta": {"command": " ".join(["python -m benchmarks.suffix_host_cost", *(argv or sys.argv[1:])]),
                       "date": date, "machine": machine(), "loadavg_before": load_before,
                       "loadavg_after": os.getloadavg(), "config": vars(args),
                       "streams": {"n": len(streams), "mean_tokens": float(np.mean([len(s) for s in streams]))}},
              "cases": cases, "memory": memory}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"memory at {memory['trie_tokens']} tokens: {memory['trie_nodes']} nodes, {memory['bytes'] / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
