"""The installed benchmark harness: `jaxspec bench` (cli), workloads, load generators, peers, plots, and the bare
matmul floor a step is measured against (docs/design.md, "Layout")."""
