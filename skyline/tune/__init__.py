"""`skyline tune`: the self-optimizing loop. Profile a workload on this device, rank kernel
families by the time they lose against their floor, tune the worst with the kernel tuners, write
the winners to this user's kernel cache (ops/tuning.py), re-measure end to end and keep only
what won.

rank.py (kernel names -> families, floors, ranking), workload.py (the workload through the
engine's public API, timed and profiled), loop.py (rounds: tune, re-measure, keep or revert),
cpu.py and gemv.py (the tuners), run.py (the command).
"""
