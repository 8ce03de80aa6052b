"""KV-cache quantization: pure functions on tensors, no dependency on ``alisa``.

``quantize(x, bits=8, group_size=None) -> QuantizedTensor`` and ``dequantize(q) -> Tensor``
implement ALISA's asymmetric min/max INT8 (and INT4, packed two per byte).
"""

from quant.asymmetric import SUPPORTED_BITS, QuantizedTensor, check_options, dequantize, quantize
from quant.packing import pack_nibbles, unpack_nibbles

__all__ = [
    "SUPPORTED_BITS",
    "QuantizedTensor",
    "check_options",
    "dequantize",
    "pack_nibbles",
    "quantize",
    "unpack_nibbles",
]
