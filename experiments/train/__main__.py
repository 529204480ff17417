"""python -m experiments.train (and torchrun -m experiments.train): the same as specdec-train."""

from experiments.train.command import main

main()
