"""Builds the one compiled part of jaxspec: the XLA:CPU cache-attention kernel (models/csrc/cache_attention.cc).

Everything else is declared in pyproject.toml. The kernel is an XLA FFI handler, so it compiles against the
headers that ship inside jaxlib (the build requirement pinned in pyproject.toml to the runtime's jaxlib).
"""

import os

import jaxlib
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "models._cache_attention",
    sources=["models/csrc/cache_attention.cc"],
    include_dirs=[os.path.join(os.path.dirname(jaxlib.__file__), "include")],
    language="c++",
    extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=fast", "-fno-trapping-math",
                        "-Wno-attributes", "-Wno-return-type", "-Wno-psabi"],
)])
