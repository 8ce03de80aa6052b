"""KV-cache quantization: pure functions on tensors, no dependency on ``alisa``.

``quantize(x, bits=8, group_size=None) -> QuantizedTensor`` and ``dequantize(q) -> Tensor``
implement ALISA's asymmetric min/max INT8 (and INT4, packed two per byte);
``quantize_rows(x) -> (codes, scales)`` is absmax INT8 per row, for products taken on the codes.
"""

from quant.asymmetric import SUPPORTED_BITS, QuantizedTensor, check_options, dequantize, quantize
from quant.packing import pack_nibbles, unpack_nibbles
from quant.symmetric import quantize_rows

__all__ = [
    "SUPPORTED_BITS",
    "QuantizedTensor",
    "check_options",
    "dequantize",
    "pack_nibbles",
    "quantize",
    "quantize_rows",
    "unpack_nibbles",
]
