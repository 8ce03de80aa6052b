"""Benchmarks and evaluations: ``python -m experiments.<script>``."""
