"""Hardware benchmarks: T(n) of a target, the verifier's time and bandwidth, and speedups projected
from a T(n) profile measured elsewhere. Run from the repository root: ``python -m benchmarks.NAME``."""
