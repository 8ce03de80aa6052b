"""Kernels' floor: which backend runs (:mod:`alisa.ops.backends`) and how compiled kernels are
cached (:mod:`alisa.ops.numba_cache`), under no alisa object.

It imports only torch, numpy, numba, Triton and :mod:`quant`, and takes tensors and arrays. This
module itself imports none of them: a config names a backend without loading torch.
"""

# The backends a cache can be asked for (AlisaConfig.kernels); "auto" picks the device's.
KERNELS = ("auto", "reference", "cpu", "cuda")

# Whether decode steps run compiled (generate's compile, --compile): "auto" picks the device's
# (alisa.ops.backends.compiles_by_default).
COMPILE = ("auto", "on", "off")
