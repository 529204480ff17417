"""Drafter checkpoints in the layouts other projects publish and serving engines load.

One module per family (``eagle``: EAGLE-1/2, EAGLE-3 and SpecForge heads; ``medusa``). Each exposes
``detect(directory) -> bool`` (does the folder hold a published head of that family), a loader
that builds our head from it for a target, refusing one that does not fit the target before any
decoding, and ``export(checkpoint_dir, out_dir, engine)`` with engine "vllm" or "sglang", which
writes a head trained here in the layout that engine's speculative config loads (``specdec-export``).

``load`` sits above them all: it tells a folder's layout from its files and registers the drafters
whose ``checkpoint`` takes any of them (eagle, eagle2, eagle3, dflash, domino, medusa). The drafter
registry imports this package with the modules of drafters/, so importing ``load`` here is what
registers those names.
"""

from drafters.formats import load  # noqa: F401  registers the drafters above
