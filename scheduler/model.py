"""Model shapes as the cost model needs them: bytes per token of KV and of hidden states, FLOPs."""

from __future__ import annotations

from dataclasses import dataclass

SCALE_BYTES = 2  # fp16 scale and zero point per quantization group


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Decoder-only transformer geometry.

    Attributes
    ----------
    num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size
        As in the HF config.
    bytes_per_element
        Weight and activation element size (2 for fp16/bf16, 4 for fp32).
    weight_bytes
        Bytes of all weights; ``None`` estimates them from the shapes.
    gated_mlp
        Llama-style gate/up/down MLP (3 matrices) instead of 2.
    windows
        Per layer, the sliding window W of a sliding-window layer (it attends to at most W
        tokens), None for a full-attention one; empty: every layer full.
    context_tokens
        The longest sequence (prompt + generated) the model was trained for
        (``max_position_embeddings``); ``None``: unknown.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    bytes_per_element: int = 2
    weight_bytes: int | None = None
    gated_mlp: bool = False
    windows: tuple[int | None, ...] = ()
    context_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "bytes_per_element",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.context_tokens is not None and (
            isinstance(self.context_tokens, bool)
            or not isinstance(self.context_tokens, int)
            or self.context_tokens < 1
        ):
            raise ValueError(f"context_tokens={self.context_tokens!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (attention + MLP)."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return attention + mlp

    @property
    def params(self) -> int:
        """All weights, embeddings counted once."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size

    @property
    def total_weight_bytes(self) -> int:
        return (
            self.weight_bytes
            if self.weight_bytes is not None
            else self.params * self.bytes_per_element
        )

    def kv_bytes_per_token(self, kv_bits: int = 16) -> float:
        """Key + value bytes of one token over all layers (quantized: codes + fp16 scale/zero)."""
        values = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        if kv_bits >= 16:
            return values * self.bytes_per_element
        groups = 2 * self.num_layers * self.num_kv_heads  # one group per token per KV head
        return values * kv_bits / 8 + groups * 2 * SCALE_BYTES

    @property
    def full_layers(self) -> int:
        """Layers that attend to every token (not a sliding window)."""
        if not self.windows:
            return self.num_layers
        return sum(window is None for window in self.windows)

    def sketch_bytes_per_token(self) -> float:
        """Device bytes of one token's key sketch over the full-attention layers
        (``retention="host"``; a sliding layer keeps its window and nothing else): half the key
        channels at half the element size, an eighth of the dense K + V; 16-bit models add a
        float32 scale per KV head to their INT8 codes."""
        codes = self.head_dim * self.bytes_per_element / 4
        scale = 0 if self.bytes_per_element >= 4 else 4
        return self.full_layers * self.num_kv_heads * (codes + scale)

    def hidden_bytes_per_token(self, hidden_bits: int = 16) -> float:
        """Bytes of one token's attention inputs over all layers (what recomputation stores)."""
        values = self.num_layers * self.hidden_size
        if hidden_bits >= 16:
            return values * self.bytes_per_element
        return values * hidden_bits / 8 + self.num_layers * 2 * SCALE_BYTES

    def decode_flops_per_token(self) -> float:
        """Matmul FLOPs of one decode token outside attention (2 per weight)."""
        return 2.0 * self.params

    def recompute_flops_per_token(self) -> float:
        """FLOPs to rebuild one token's K and V in every layer from its attention input."""
        return 2.0 * self.num_layers * self.hidden_size * 2 * self.num_kv_heads * self.head_dim


MODEL_PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="opt-6.7b",
            context_tokens=2048,
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=32,
            head_dim=128,
            intermediate_size=16384,
            vocab_size=50272,
        ),
        ModelSpec(
            name="opt-13b",
            context_tokens=2048,
            num_layers=40,
            hidden_size=5120,
            num_heads=40,
            num_kv_heads=40,
            head_dim=128,
            intermediate_size=20480,
            vocab_size=50272,
        ),
        ModelSpec(
            name="opt-30b",
            context_tokens=2048,
            num_layers=48,
            hidden_size=7168,
            num_heads=56,
            num_kv_heads=56,
            head_dim=128,
            intermediate_size=28672,
            vocab_size=50272,
        ),
        ModelSpec(
            name="llama-2-7b",
            context_tokens=4096,
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=32,
            head_dim=128,
            intermediate_size=11008,
            vocab_size=32000,
            gated_mlp=True,
        ),
        ModelSpec(
            name="llama-2-13b",
            context_tokens=4096,
            num_layers=40,
            hidden_size=5120,
            num_heads=40,
            num_kv_heads=40,
            head_dim=128,
            intermediate_size=13824,
            vocab_size=32000,
            gated_mlp=True,
        ),
        ModelSpec(
            name="smollm2-135m",
            context_tokens=8192,
            num_layers=30,
            hidden_size=576,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            intermediate_size=1536,
            vocab_size=49152,
            gated_mlp=True,
        ),
    )
}


def model_preset(name: str) -> ModelSpec:
    """A model shape by name; the error lists the known names."""
    if name.lower() not in MODEL_PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; known: {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[name.lower()]
