"""KV storage: the store protocol, dense and quantized stores, tiered regions, recall pool."""
