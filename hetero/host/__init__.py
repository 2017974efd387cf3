"""The machine under the engine: its BLAS, hetero's CPU kernels, wired memory, switches from the environment, per-machine settings and progress on stderr."""
