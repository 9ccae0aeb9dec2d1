"""`skyline quantize`: calibrated checkpoints and the per-layer format search."""
