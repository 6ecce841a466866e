"""Builds the compiled parts of jaxspec where it can: the XLA:CPU kernels in jaxspec/models/csrc (cache attention,
panel matmul).

Everything else is declared in pyproject.toml. The kernels are XLA FFI handlers, so they compile against the
headers that ship inside jaxlib (the build requirement pinned in pyproject.toml to the runtime's jaxlib). They are
optional: where no C++17 compiler works (none on the PATH, `CXX=false`, a failed compile) the package installs
without them, the build log says so, and the engine runs the XLA form (`jaxspec.models.cpu_kernels`).
"""

import os
import sys

import jaxlib
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

KERNELS = ("cache_attention", "panel_matmul")
# jaxlib's FFI headers as system headers: their own warnings (-Wreturn-type, -Wsign-compare) are not ours to fix
FFI_HEADERS = os.path.join(os.path.dirname(jaxlib.__file__), "include")
COMPILE_ARGS = ["-std=c++17", "-O3", "-ffp-contract=fast", "-fno-trapping-math", "-Wno-attributes", "-Wno-psabi",
                "-isystem", FFI_HEADERS]
# the second try, for compilers and platforms without function multiversioning (target_clones needs ifunc)
NO_CLONES = "-DJAXSPEC_NO_TARGET_CLONES"


class OptionalKernels(build_ext):
    """Builds each kernel with per-CPU variants (target_clones), else with the compiler's default target only,
    else not at all, saying so: the package then installs and runs without it."""

    def build_extension(self, ext: Extension) -> None:
        base_args = list(ext.extra_compile_args)
        last_error = ""
        for extra in ([], [NO_CLONES]):
            ext.extra_compile_args = base_args + extra
            try:
                super().build_extension(ext)
                if extra:
                    print(f"jaxspec: built {ext.name} without per-CPU variants (target_clones did not compile here)",
                          file=sys.stderr, flush=True)
                return
            except (CCompilerError, CompileError, ExecError, LinkError, PlatformError, OSError) as error:
                compiler = (getattr(self.compiler, "compiler_so", None) or ["the compiler"])[0]
                last_error = str(error) if len(str(error)) < 200 else f"{compiler} failed"
            finally:
                ext.extra_compile_args = base_args
        print(f"jaxspec: WARNING: the XLA:CPU kernel {ext.name} was not built (with and without target_clones: "
              f"{last_error}; any compiler output is above). jaxspec installs without it and runs the XLA "
              "form on CPU (slower steps); to get the kernel, install a C++17 compiler (g++ or clang++) and "
              "reinstall jaxspec.", file=sys.stderr, flush=True)


setup(
    ext_modules=[Extension(
        f"jaxspec.models._{name}",
        sources=[f"jaxspec/models/csrc/{name}.cc"],
        depends=["jaxspec/models/csrc/target_clones.h"],
        language="c++",
        extra_compile_args=COMPILE_ARGS,
        optional=True,
    ) for name in KERNELS],
    cmdclass={"build_ext": OptionalKernels},
)
