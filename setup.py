"""Builds the compiled parts of jaxspec: the XLA:CPU kernels in jaxspec/models/csrc (cache attention, panel matmul).

Everything else is declared in pyproject.toml. The kernels are XLA FFI handlers, so they compile against the
headers that ship inside jaxlib (the build requirement pinned in pyproject.toml to the runtime's jaxlib).
"""

import os

import jaxlib
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    f"jaxspec.models._{name}",
    sources=[f"jaxspec/models/csrc/{name}.cc"],
    include_dirs=[os.path.join(os.path.dirname(jaxlib.__file__), "include")],
    language="c++",
    extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=fast", "-fno-trapping-math",
                        "-Wno-attributes", "-Wno-return-type", "-Wno-psabi"],
) for name in ("cache_attention", "panel_matmul")])
