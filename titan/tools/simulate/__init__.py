"""The scale simulator: one CPU process plays one rank of an N-rank job (scripts/simulate.py)."""
