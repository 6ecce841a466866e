"""The engine: its contract, the compiled JAX engine and a fake one, building it from flags, the compiled menu,
multi-process mirroring and the device profiler (docs/design.md, "The engine contract")."""
