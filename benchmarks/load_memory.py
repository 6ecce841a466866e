"""Peak host memory while loading a model: the streaming loader vs the old whole-state-dict path.

    python -m benchmarks.load_memory --model SPEC --dtype bfloat16 [--paths streaming whole] [--cap-gib 12] \
        [--out docs/results/load_memory.json]

Each path runs in a fresh subprocess (so one path's allocations cannot lower or raise the other's
peak) and loads the model into its serving layout on one device (`serving_split`, as an engine does):

  streaming  `build_model(spec, dtype=...)`: jaxspec.models.loading.streaming, tensor by tensor.
  whole      the old path: `load_model(spec)` (whole float32 state dict) -> `from_hf_state_dict`
             (stacked, cast) -> `serving_split` (fused copy).

Reported per path: peak RSS (`getrusage(RUSAGE_SELF).ru_maxrss`), RSS after importing jax and
starting its backend (the floor every path pays), the serving weights' bytes, load seconds. The
parent samples each child's RSS and kills it above `--cap-gib` (reported as `killed_over_cap`), so a
path that would exhaust the machine is stopped, not run. Prints one JSON object (the command, date, machine and
load average before and after with the rows) and writes it to `--out` when given.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time

GIB = 1024**3


def _rss_bytes(pid: int | str = "self") -> int:
    """Current resident set of a process (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _child(path: str, spec: str | None, dtype: str) -> dict:
    """Load `spec` by `path` in this (fresh) process and report its memory."""
    import jax

    from jaxspec.engine.kernels import kernel_plan_for
    from jaxspec.mesh import MeshSpec, make_mesh
    from jaxspec.models.llama import serving_split
    from jaxspec.models.sharding import plan_layout, serving_placement

    jax.devices()  # start the backend: part of the floor, not of the load
    floor = _rss_bytes()
    start = time.perf_counter()
    if path == "streaming":
        from jaxspec.engine.build import build_model

        model = build_model(spec, dtype=dtype).model
    else:
        from jaxspec.models.llama import from_hf_state_dict
        from jaxspec.models.loading import load_model

        def whole():
            loaded = load_model(spec)  # no cache dir: the file is dequantised here
            return from_hf_state_dict(loaded.config.replace(dtype=dtype), loaded.state_dict)

        model = whole()
    one_device = MeshSpec()  # the placement build_model streams into (its kernel plan's weight layout), both paths
    placement = serving_placement(make_mesh(one_device), plan_layout(model.config, 1),
                                  kernel_plan_for(model.config, one_device))
    params, layers = serving_split(model, placement)[1]  # what an engine places (a memo hit when streamed)
    # the placed arrays (a column-panel weight is a pytree over its panels array)
    arrays = jax.tree.leaves([v.value for _, v in params.flat_state()] + [layer for layer in layers])
    jax.block_until_ready(arrays)
    seconds = time.perf_counter() - start
    serving_bytes = sum(s.data.nbytes for a in arrays for s in a.addressable_shards)
    return {"path": path, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
            "floor_rss_gib": floor / GIB, "rss_after_gib": _rss_bytes() / GIB,
            "serving_weights_gib": serving_bytes / GIB, "load_seconds": round(seconds, 1),
            "model": model.config.name, "dtype": model.config.dtype,
            "params": model.config.num_params}


def _run_path(path: str, spec: str | None, dtype: str, cap_gib: float) -> dict:
    """Run one path in a subprocess, sampling its RSS; kill it above the cap."""
    cmd = [sys.executable, "-m", "benchmarks.load_memory", "--child", path, "--dtype", dtype]
    if spec is not None:
        cmd += ["--model", spec]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampled = 0
    while proc.poll() is None:
        try:
            sampled = max(sampled, _rss_bytes(proc.pid))
        except (FileNotFoundError, RuntimeError, ProcessLookupError):
            pass  # the child exited between poll() and the read
        if sampled > cap_gib * GIB:
            proc.kill()
            proc.wait()
            return {"path": path, "killed_over_cap": True, "cap_gib": cap_gib, "sampled_rss_gib": sampled / GIB}
        time.sleep(0.1)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{path} load failed (exit {proc.returncode}):\n{err[-4000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["sampled_rss_gib"] = sampled / GIB
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model spec (default: the default model)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--paths", nargs="+", default=["streaming", "whole"], choices=("streaming", "whole"))
    parser.add_argument("--cap-gib", type=float, default=12.0, help="kill a path whose RSS passes this")
    parser.add_argument("--out", default=None, help="also write the JSON report to this file")
    parser.add_argument("--child", choices=("streaming", "whole"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = _child(args.child, args.model, args.dtype)
        print(json.dumps(result))
        return result
    load_before = os.getloadavg()
    rows = {p: _run_path(p, args.model, args.dtype, args.cap_gib) for p in args.paths}
    mem_total_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    command = ["python", "-m", "benchmarks.load_memory", *(sys.argv[1:] if argv is None else argv)]
    report = {"command": " ".join(shlex.quote(a) for a in command),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), {mem_total_gib:.1f} GiB RAM, "
                         f"Python {platform.python_version()}",
              "model": args.model, "dtype": args.dtype, "host": platform.node(), "cpus": os.cpu_count(),
              "mem_total_gib": mem_total_gib,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "paths": rows}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
