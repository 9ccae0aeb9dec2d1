"""`skyline train-speculator`: an EAGLE head trained on the target's own features."""
