// JAXSPEC_CLONES: on x86-64 a function marked with it is compiled three times (AVX-512, AVX2 + FMA, baseline),
// the variant picked at load time; elsewhere (aarch64 hosts, compilers or C libraries without them) once, for the
// compiler's default target. The variants need function multiversioning (an ifunc: ELF, glibc) and a compiler that
// has it; setup.py builds again with JAXSPEC_NO_TARGET_CLONES where a compile with them fails.
#ifndef JAXSPEC_TARGET_CLONES_H_
#define JAXSPEC_TARGET_CLONES_H_

#if defined(__x86_64__) && defined(__ELF__) && defined(__GLIBC__) && defined(__has_attribute) && \
    !defined(JAXSPEC_NO_TARGET_CLONES)
#if __has_attribute(target_clones)
#define JAXSPEC_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef JAXSPEC_CLONES
#define JAXSPEC_CLONES
#endif

#endif  // JAXSPEC_TARGET_CLONES_H_
