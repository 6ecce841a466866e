"""The compiled menu: one executable per shape key, compiled ahead of time, in parallel, and looked up by key.

`CompiledMenu.warmup` lowers each shape (Python, one at a time: tracing holds the GIL), compiles the lowered
modules on a thread pool (XLA compiles outside the GIL, and JAX's persistent compilation cache answers repeats),
then runs each new executable once through a callback (a first run pays one-time setup that would otherwise land
in a request). A shape that was not compiled raises `MenuMissError` (docs/design.md, "Static shapes").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

from tqdm import tqdm

from jaxspec.menu import Menu, MenuMissError, ShapeKey


def default_compile_workers() -> int:
    """Threads compiling at once: one per core ($JAXSPEC_COMPILE_WORKERS overrides; 1 compiles serially)."""
    value = os.environ.get("JAXSPEC_COMPILE_WORKERS")
    if value is None:
        return os.cpu_count() or 1
    workers = int(value)
    if workers < 1:
        raise ValueError(f"$JAXSPEC_COMPILE_WORKERS must be >= 1, got {value!r}")
    return workers


class CompiledMenu:
    """Executables by shape key. `lower(key)` gives a lowered (not yet compiled) `jax.stages.Lowered`."""

    def __init__(self, menu: Menu, lower: Callable[[ShapeKey], object]):
        self.menu = menu
        self._lower = lower
        self._executables: dict[ShapeKey, Callable] = {}

    def __contains__(self, key: ShapeKey) -> bool:
        return key in self._executables

    def keys(self) -> list[ShapeKey]:
        return list(self._executables)

    def get(self, key: ShapeKey) -> Callable:
        """The compiled executable of `key`; `MenuMissError` if warm-up did not compile it."""
        try:
            return self._executables[key]
        except KeyError:
            m = self.menu
            raise MenuMissError(f"shape {key} was not compiled in warm-up (menu: B={m.batch_buckets}, "
                                f"k={m.k_menu}, W={m.window_buckets}, C={m.prefill_buckets})") from None

    def warmup(self, keys: Sequence[ShapeKey], run_once: Callable[[ShapeKey], None], progress: bool = True,
               workers: int | None = None) -> int:
        """Compile every key not compiled yet (`workers` threads; default `default_compile_workers()`), then
        `run_once` each new one in key order. Any failure raises, naming the shape. Returns the number compiled."""
        new = [key for key in dict.fromkeys(keys) if key not in self._executables]
        workers = default_compile_workers() if workers is None else workers
        bar = tqdm(total=len(new), desc="compiling menu", unit="shape", disable=not progress or not new, leave=False)
        compiled: dict[ShapeKey, Callable] = {}
        try:
            if workers == 1:
                for key in new:
                    compiled[key] = self._compile_one(key)
                    bar.update()
            else:
                with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jaxspec-compile") as pool:
                    futures = {}
                    for key in new:  # lowering traces Python: one at a time, while earlier keys compile
                        lowered = self._lower_one(key)
                        futures[pool.submit(self._compile_lowered, key, lowered)] = key
                    for future in as_completed(futures):
                        compiled[futures[future]] = future.result()
                        bar.update()
        finally:
            bar.close()
        for key in new:
            self._executables[key] = compiled[key]
            try:
                run_once(key)
            except Exception as exc:  # re-raised with the shape that failed
                raise RuntimeError(f"warming up {key} (first run) failed: {exc}") from exc
        return len(new)

    def _lower_one(self, key: ShapeKey):
        try:
            return self._lower(key)
        except Exception as exc:  # re-raised with the shape that failed
            raise RuntimeError(f"warming up {key} (lowering) failed: {exc}") from exc

    @staticmethod
    def _compile_lowered(key: ShapeKey, lowered) -> Callable:
        try:
            return lowered.compile()
        except Exception as exc:  # re-raised with the shape that failed
            raise RuntimeError(f"warming up {key} (compile) failed: {exc}") from exc

    def _compile_one(self, key: ShapeKey) -> Callable:
        return self._compile_lowered(key, self._lower_one(key))
