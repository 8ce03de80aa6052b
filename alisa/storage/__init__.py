"""KV storage: the store protocol, dense and quantized stores, tiered regions, and the host
pages and key sketch of ``retention="host"``."""
