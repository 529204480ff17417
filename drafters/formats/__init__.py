"""Drafter checkpoints in the layouts other projects publish and serving engines load.

One module per family (``eagle``: EAGLE-1/2, EAGLE-3 and SpecForge heads; ``medusa``). Each exposes
``detect(directory) -> bool`` (does the folder hold a published head of that family), a loader
that builds our head from it for a target, refusing one that does not fit the target before any
decoding, and ``export(checkpoint_dir, out_dir, engine)`` with engine "vllm" or "sglang", which
writes a head trained here in the layout that engine's speculative config loads (``specdec-export``).
"""
