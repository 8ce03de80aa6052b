"""A pytest plugin: run the suite with the kernel choices of a CPU with native bfloat16.

Issue 64: the suite must pass on every CPU kind. An AVX-512 BF16 (or AMX, Arm BF16) CPU
reports oneDNN bfloat16, so ``choose_ops`` picks PyTorch's bfloat16 sketch product and the
selection in separate calls where an AVX2 CPU runs the compiled product and one fused call.
This plugin makes this machine report it too, so the whole suite runs that selection here
(the products then take oneDNN's slow path on a CPU without it: correct, slower):

    PYTHONPATH=probes python -m pytest -p as_bf16_cpu tests

Tests run in subprocesses (the CLI's) keep this machine's own choice.
"""

import alisa.ops.backends as backends
import alisa.record as record


def _native_bfloat16() -> bool:
    return True


backends.cpu_bfloat16 = _native_bfloat16
record.cpu_bfloat16 = _native_bfloat16
