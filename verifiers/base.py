"""What a verifier implementation needs: the tree it walks, the noise it consumes, what it returns.

The types live in the core (the decode loop creates and reads them); they are re-exported here.
"""

from specdec.noise import VerifyNoise
from specdec.protocols import Verifier, VerifyResult
from specdec.sampling import SamplingParams, probabilities
from specdec.tree import DraftTree, SiblingMode


class UnverifiableTreeError(ValueError):
    """A tree this verifier cannot verify exactly (a chain-only rule given a tree, a shape the rule
    needs static): a setting to change, not a bug."""


__all__ = [
    "DraftTree",
    "SamplingParams",
    "SiblingMode",
    "UnverifiableTreeError",
    "Verifier",
    "VerifyNoise",
    "VerifyResult",
    "probabilities",
]
