"""python -m experiments.run: the same as specdec-run."""

from experiments.run.command import main

main()
