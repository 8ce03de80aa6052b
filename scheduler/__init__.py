"""Three-phase KV scheduling (device / host / recompute): pure Python and pulp, no torch."""
