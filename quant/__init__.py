"""KV-cache quantization: pure functions on tensors, no dependency on ``alisa``."""
