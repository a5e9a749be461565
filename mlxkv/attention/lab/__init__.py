"""The kernel lab: what checks, models and times the Metal kernels, apart from the runtime path and
loaded only by the tests, the benchmarks and `mlxkv doctor`.

`simulator` runs the kernel bodies on a CPU behind `mx.fast.metal_kernel`'s signature, each built by
`build` (type-checked as Metal, compiled as C++, cached); `cost_model` turns a launch's counted work
into a modelled time on an Apple GPU, its counts kept on disk by `count_cache`; `speed` times the
paged kernel against MLX's SDPA on a Mac.
"""
