"""A transformers KV cache whose layers append in place.

transformers' DynamicLayer grows by ``torch.cat``, so every forward copies each layer's whole cache
to add a few columns, which showed in profiles of long batched decoding (docs/RESULTS.md). A
GrowingLayer keeps each tensor in a buffer with spare columns (doubled when full, so growth copies are amortised) and hands attention a view of its
first ``length`` columns. Everything else keeps DynamicLayer's semantics through the ``keys`` /
``values`` attributes: assigning a prefix view of the buffer (DynamicLayer.crop, a layer-skip
drafter restoring what it saved) only moves the length; assigning any other tensor
(HFTarget.retain's row selection, stacking caches at admission) copies it into a fresh buffer.
"""

from __future__ import annotations

from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    def __init__(self, **kwargs) -> None:
        self._buffers: dict[str, Tensor | None] = {"keys": None, "values": None}  # [B, H, capacity, D]
        self._lengths = {"keys": 0, "values": 0}
        super().__init__(**kwargs)

    keys = property(lambda self: self._view("keys"), lambda self, tensor: self._assign("keys", tensor))
    values = property(lambda self: self._view("values"), lambda self, tensor: self._assign("values", tensor))

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._append("keys", key_states), self._append("values", value_states)

    def get_seq_length(self) -> int:
        return self._lengths["keys"]

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` columns (transformers 5.24's sign; 5.17 took a
        positive length to keep): only the lengths move. DynamicLayer's crop assigns prefix views,
        which cost HFTarget a property round trip per layer and tensor on every speculative step."""
        if not self.is_initialized:
            return
        keep = tokens_to_remove if tokens_to_remove > 0 else self.get_seq_length() + tokens_to_remove
        for name in self._lengths:
            self._lengths[name] = max(0, min(keep, self._lengths[name]))

    def _view(self, name: str) -> Tensor | None:  # [B, H, length, D]
        buffer = self._buffers[name]
        return None if buffer is None else buffer[:, :, : self._lengths[name]]

    def _assign(self, name: str, tensor: Tensor | None) -> None:
        buffer = self._buffers[name]
        if tensor is None or tensor.dim() != 4:  # DynamicLayer's reset (None) and lazy init (an empty 1-D tensor)
            self._buffers[name], self._lengths[name] = None, 0
        elif buffer is not None and _is_prefix(tensor, buffer):
            self._lengths[name] = tensor.shape[2]
        else:
            self._buffers[name] = _with_spare_columns(tensor, tensor.shape[2])
            self._lengths[name] = tensor.shape[2]

    def _append(self, name: str, new: Tensor) -> Tensor:  # new [B, H, Q, D] -> all columns [B, H, length + Q, D]
        buffer, length = self._buffers[name], self._lengths[name]
        needed = length + new.shape[2]
        if buffer is None:
            buffer = _with_spare_columns(new[:, :, :0], needed)
        elif needed > buffer.shape[2]:
            buffer = _with_spare_columns(buffer[:, :, :length], needed)
        buffer[:, :, length:needed] = new
        self._buffers[name], self._lengths[name] = buffer, needed
        return buffer[:, :, :needed]


def _with_spare_columns(tensor: Tensor, needed: int) -> Tensor:
    """A buffer holding ``tensor`` [B, H, C, D] in its first C columns, with room for twice
    ``needed`` columns."""
    batch, heads, columns, dim = tensor.shape
    buffer = tensor.new_empty(batch, heads, max(2 * needed, 16), dim)
    buffer[:, :, :columns] = tensor
    return buffer


def _is_prefix(tensor: Tensor, buffer: Tensor) -> bool:
    """Whether ``tensor`` is ``buffer[:, :, :n]`` for some n (same memory, same layout)."""
    return (
        tensor.data_ptr() == buffer.data_ptr()
        and tensor.stride() == buffer.stride()
        and tensor.shape[:2] == buffer.shape[:2]
        and tensor.shape[3] == buffer.shape[3]
        and tensor.shape[2] <= buffer.shape[2]
    )


def growing_cache() -> DynamicCache:
    """A DynamicCache whose layers (created on first use, one per decoder layer) are GrowingLayers."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache
