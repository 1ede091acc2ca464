"""kvpool benchmarks: tiers, transfers, master; shared CLI and output in ``bench.common``."""
