"""How a head's weights lie in its model.safetensors: as saved (any dtype), or compacted to int8 rows.

A compacted file stores every floating matrix ``name`` of a head as int8 values ``name`` (the same
shape) and one float32 scale per row ``name + SCALE_SUFFIX`` (the matrix's shape less its last
dimension): the row's largest magnitude over 127, so that ``value * scale`` is within half a scale
of the saved weight. Vectors (norms, biases) and integer buffers (a draft vocabulary's ids) stay as
they were. The file's metadata names the scheme and the dtype the head was saved in, which reading
restores: every reader of head weights goes through ``read_weights`` and ``weight_shapes``, so a
compacted head loads, checks and exports as the head it was saved as, with rounded values.

The bundled heads are stored this way (drafters/checkpoints/MANIFEST.json records each one's dtype),
to keep the repository and the wheel small; acceptance with them is held to the saved heads' by
tests/test_acceptance_regression.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors
import torch
from torch import Tensor

SCHEME_KEY, DTYPE_KEY = "specdec_storage", "specdec_dtype"
INT8_ROWS = "int8-rows"
SCALE_SUFFIX = ".row_scale"
MIN_ELEMENTS = 4096  # smaller matrices gain nothing worth their rounding


def saved_dtype(tensors: dict[str, Tensor]) -> str:
    """The one floating dtype of a head's state (``float16``); ValueError for none or several."""
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"a head to compact holds one floating dtype, this one {sorted(dtypes) or 'none'}")
    return dtypes.pop()


def compact_int8_rows(tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``tensors`` (one head's state, a single floating dtype) stored as int8 rows, with the metadata
    ``read_weights`` decodes them by. ValueError for a state of mixed floating dtypes."""
    dtype = saved_dtype(tensors)
    stored = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            raise ValueError(f"tensor {name!r} ends with {SCALE_SUFFIX!r}, which the int8 rows scheme reserves")
        if not tensor.is_floating_point() or tensor.dim() < 2 or tensor.numel() < MIN_ELEMENTS:
            stored[name] = tensor.contiguous()
            continue
        weight = tensor.float()
        scale = weight.abs().amax(-1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
        stored[name] = torch.round(weight / scale[..., None]).clamp(-127, 127).to(torch.int8).contiguous()
        stored[name + SCALE_SUFFIX] = scale.contiguous()
    return stored, {"format": "pt", SCHEME_KEY: INT8_ROWS, DTYPE_KEY: dtype}


def read_weights(path: Path) -> dict[str, Tensor]:
    """The tensors of a head's weight file as the head was saved: decoded from int8 rows to its saved
    dtype where the file is compacted, as they are otherwise."""
    with safetensors.safe_open(str(path), "pt") as file:
        metadata = file.metadata() or {}
        tensors = {name: file.get_tensor(name) for name in file.keys()}
    scheme = metadata.get(SCHEME_KEY)
    if scheme is None:
        return tensors
    if scheme != INT8_ROWS:
        raise ValueError(f"{path} is stored as {scheme!r}, which this specdec does not read (it reads {INT8_ROWS!r})")
    dtype = getattr(torch, metadata.get(DTYPE_KEY, ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{path}: its metadata names no dtype to decode to ({DTYPE_KEY}={metadata.get(DTYPE_KEY)!r})")
    decoded = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        decoded[name] = tensor if scale is None else (tensor.float() * scale[..., None]).to(dtype)
    return decoded


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a head's weight file holds, as the head has it, from the header alone
    (the weights stay unread). ValueError for a file that is not one, or is cut short: its header
    lists every tensor's bytes, so a truncated file is shorter than the header says."""
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 2 <= length <= size - 8:
            raise ValueError(f"{path} is not a safetensors file, or is cut short (its header does not fit in its "
                             f"{size} bytes)")
        try:
            header = json.loads(file.read(length))
            tensors = {name: info for name, info in header.items() if name != "__metadata__"}
            end = max((int(info["data_offsets"][1]) for info in tensors.values()), default=0)
            compacted = (header.get("__metadata__") or {}).get(SCHEME_KEY) is not None
            shapes = {name: tuple(int(n) for n in info["shape"]) for name, info in tensors.items()
                      if not (compacted and name.endswith(SCALE_SUFFIX))}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
            raise ValueError(f"{path}: its safetensors header does not read ({error})") from None
    if 8 + length + end > size:
        raise ValueError(f"{path} is cut short: its header lists {8 + length + end} bytes, the file holds {size}")
    return shapes
