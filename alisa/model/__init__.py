"""The model side: loading checkpoints (hub ids, directories, GGUF files, the built-in models) and
inspecting a loaded model once (:mod:`.adapter`: shape, attention modules, rotary, projections)."""
