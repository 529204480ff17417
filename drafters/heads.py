"""What the trained-head drafters (EAGLE, MTP, Medusa, Domino) share: the layers they are built
from, their checkpoint format and the bundled checkpoints (per packaged target), and the target modules and
kernels they draft with.

A head is saved as a folder (``save_head``): config.json, with the head's config under the head's
kind and any extra records beside it, and model.safetensors. ``load_checkpoint`` reads any kind
back and checks it was trained for the target it is loaded on.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.base import TargetSizes
from drafters.bundled import BUNDLED, verified
from drafters.head_storage import read_weights, weight_shapes
from specdec.files import replace_folder
from specdec.cpu_kernels import pack_linears
from specdec.packaged_models import PACKAGED_MODELS
from specdec.protocols import HeadTarget

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def packaged_name(target: str) -> str | None:
    """The packaged model (specdec/packaged_models.py) that ``target`` (a target's key, Target.key) is,
    which names what drafters/checkpoints bundles for it; None for others."""
    return target if target in PACKAGED_MODELS else None


def bundled_checkpoint(kind: str, method: str, target: str) -> Path:
    """The ``kind`` head bundled for ``target`` (a target's name, its model folder): the folder
    ``<kind>-<packaged model>`` under drafters/checkpoints, for a packaged model's converted folder.
    A ValueError naming the specdec-train command that trains one otherwise."""
    packaged = packaged_name(target)
    path = BUNDLED / f"{kind}-{packaged}"
    if packaged is None or not path.is_dir():
        train = f"specdec-train train={method}" + (f" target={packaged} output=drafters/checkpoints/{kind}-{packaged}"
                                                    if packaged else " target=... output=DIR")
        raise ValueError(f"no {kind} head is bundled for {target}; train one with `{train}`, "
                         f"or pass drafter.checkpoint=<its output dir>")
    return verified(path)


class RMSNorm(nn.Module):
    """x / rms(x), scaled per channel by a learned weight (no bias, no mean subtraction)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotate(x: Tensor, positions: Tensor, theta: float) -> Tensor:  # [B, H, R, D], [B, R]
    """RoPE with base ``theta``, in the half-split layout of Llama-family models."""
    half = x.shape[-1] // 2
    frequencies = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions[:, None, :, None].float() * frequencies  # [B, 1, R, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], -1)


def register_draft_ids(head: nn.Module, draft_ids: Tensor | None, size: int) -> None:
    """The target token ids a head drafts from ([size] int64, all of them when None), as a buffer
    that checkpoints carry."""
    if draft_ids is None:
        draft_ids = torch.arange(size)
    if draft_ids.shape != (size,):
        raise ValueError(f"draft_ids must hold draft_vocab_size={size} token ids")
    head.register_buffer("draft_ids", draft_ids.to(torch.int64))


class DecoderBlock(nn.Module):
    """One pre-norm decoder layer (RoPE attention, SwiGLU MLP) whose rows keep their keys and values
    in a static cache the caller owns; the EAGLE head, the MTP modules and Domino's block layers build on it.

    A subclass calls ``add_block`` after creating its own input layers: a resumed optimizer state is
    matched to parameters by their order of creation."""

    def add_block(self, hidden_size: int, num_heads: int, intermediate_size: int, rope_theta: float, rms_eps: float) -> None:
        self.num_heads, self.rope_theta = num_heads, rope_theta
        self.attention_norm = RMSNorm(hidden_size, rms_eps)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp_norm = RMSNorm(hidden_size, rms_eps)
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def block(
        self,
        x: Tensor,  # [B, R, H] fused inputs
        positions: Tensor,  # [B, R] int64
        keys: Tensor | None,  # [B, heads, S, D] cache to attend to (None: rows attend to themselves only)
        values: Tensor | None,
        mask: Tensor,  # [B, R, S(+R)] bool, True = visible
        write: Tensor | None = None,  # [B, R] int64 cache slots the rows' keys/values go to
    ) -> Tensor:  # [B, R, H]
        q, k, v = self.attention_inputs(x, positions)
        if keys is None:
            keys, values = k, v
        else:
            index = write[:, None, :, None].expand(-1, self.num_heads, -1, k.shape[-1])
            keys.scatter_(2, index, k)
            values.scatter_(2, index, v)
        return self.after_attention(x, F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None]))

    def attention_inputs(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries and keys (rotated to ``positions`` [B, R]) and values [B, heads, R, D] of rows x [B, R, H]."""
        b, r, h = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(b, r, 3, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)
        return rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta), v

    def after_attention(self, x: Tensor, attended: Tensor) -> Tensor:  # [B, R, H], [B, heads, R, D] -> [B, R, H]
        """The rest of the layer: the attention output projected and added, then the MLP's."""
        b, r, h = x.shape
        x = x + self.out(attended.transpose(1, 2).reshape(b, r, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


def causal_rows(features: Tensor) -> tuple[Tensor, None, None, Tensor]:
    """positions [B, T] and a causal mask [B, T, T] for a training sequence, no cache."""
    b, t = features.shape[:2]
    positions = torch.arange(t, device=features.device).expand(b, t)
    return positions, None, None, torch.ones(t, t, dtype=torch.bool, device=features.device).tril().expand(b, t, t)


def use_target_kernels(module: nn.Module, target: HeadTarget) -> nn.Module:
    """A drafter's own linear layers on the CPU kernels its target chose (specdec.cpu_kernels):
    oneDNN's packed GEMM from the row count the target timed. A head runs as few rows as the target
    and is as wide as one of its layers, so where the stock few-row kernels are slow they slow the
    head as much as the target (docs/RESULTS.md, "Heads on the target's kernels"). A no-op for a
    target on stock kernels (a GPU, packed_gemm_from=null); training is unaffected (a packed layer
    takes the stock kernel under autograd)."""
    if target.packed_gemm_from is not None:
        pack_linears(module, target.packed_gemm_from)
    return module


def token_embedding(target: HeadTarget) -> Callable[[Tensor], Tensor]:
    """Token ids [...] -> rows [..., H] of the target's input-embedding table, looked up bare, not
    through the embedding layer's forward: heads train on the bare table (drafters/training/data.py
    HeadData), and engines hand a draft model the table in a plain embedding. Gemma's layer also
    multiplies by sqrt(hidden size), so calling it drafted from inputs 25 times the size trained on."""
    return partial(F.embedding, weight=target.model.get_input_embeddings().weight)


def draft_lm_head(target: HeadTarget, draft_ids: Tensor) -> nn.Module:
    """The target's frozen LM head restricted to ``draft_ids`` [K] (a head's draft vocabulary), as
    a module [..., H] -> [..., K] on the target's kernels."""
    rows = target.model.get_output_embeddings().weight.detach()[draft_ids]  # [K, H]
    layer = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    layer.weight = nn.Parameter(rows, requires_grad=False)
    return use_target_kernels(nn.Sequential(layer), target)  # packing swaps a container's children


def catch_up_runs(counts: Sequence[int], prompt_rows: int = 32) -> list[slice]:
    """Contiguous runs of a batch whose requests bring ``counts`` new rows each, for a drafter that
    pads every request of one call to the call's longest: requests bringing more than
    ``prompt_rows`` rows (a prompt just admitted) and the others (a step's accepted rows) never
    share a run: one call over a batch with an admission would compute the prompt's length for
    every request (B x L rows at batch B). SpecDecoder appends admitted requests, so a step with an
    admission has two runs; linear in B, since batches of thousands of requests go through it."""
    runs, start = [], 0
    for end in range(1, len(counts) + 1):
        if end == len(counts) or (counts[end] > prompt_rows) != (counts[start] > prompt_rows):
            runs.append(slice(start, end))
            start = end
    return runs


def save_head(head: nn.Module, directory: str | Path, extra: dict | None = None, kind: str = "eagle") -> None:
    """config.json (the head's config under ``kind``) + model.safetensors; every head kind (EAGLE,
    MTP, Medusa, Domino) is saved here."""
    write_checkpoint(directory, {kind: asdict(head.config), **(extra or {})}, head.state_dict())


def check_export_folder(directory: Path) -> None:
    """An export goes into a new or empty folder, or replaces an earlier export (its config.json and
    model.safetensors, nothing else): anything more is someone's other files, which an export must
    not swap out."""
    if directory.exists() and not (directory.is_dir() and {p.name for p in directory.iterdir()} <= {CONFIG_FILE, WEIGHTS_FILE}):
        raise FileExistsError(f"{directory} exists and holds more than an earlier export ({CONFIG_FILE}, {WEIGHTS_FILE}); "
                              f"choose a new folder")


def write_checkpoint(directory: str | Path, config: dict, tensors: dict[str, Tensor]) -> None:
    """config.json + model.safetensors, swapped in whole for any folder already there
    (specdec.files.replace_folder), readable by every user: a serving engine may read an export as
    another user than the one who wrote it."""
    check_free_space(Path(directory), sum(t.numel() * t.element_size() for t in tensors.values()))

    def write(folder: Path) -> None:
        folder.mkdir()
        safetensors.torch.save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                                    str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        os.chmod(folder, 0o755)  # whatever the writer's umask
        for file in folder.iterdir():
            os.chmod(file, 0o644)

    replace_folder(Path(directory), write)


def check_free_space(destination: Path, needed: int) -> None:
    """OSError(ENOSPC) naming ``destination`` before anything is written, when its file system has
    fewer than ``needed`` bytes free (the weights, plus a MiB for the config and the file headers)."""
    folder = destination
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free < needed + 2**20:
        raise OSError(errno.ENOSPC, f"No space left: {needed / 2**20:.1f} MiB to write, {free / 2**20:.1f} MiB free",
                      str(destination))


def target_shape(target: HeadTarget) -> dict:
    """The config fields every head built on a target shares (EAGLE, MTP, Domino): its sizes, RoPE
    base, and name (checked against the target when a checkpoint loads)."""
    config = target.model.config
    # the MLP width has three names across families; GPT-2 may leave it unset (meaning 4x hidden)
    width = next((getattr(config, n) for n in ("intermediate_size", "ffn_dim", "n_inner") if getattr(config, n, None)), None)
    # transformers 5 keeps the RoPE base in rope_parameters; learned-position models have none
    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma-3 keeps one set per attention kind
    theta = rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return dict(
        hidden_size=target.hidden_size,
        num_heads=config.num_attention_heads,
        intermediate_size=width or 4 * target.hidden_size,
        vocab_size=target.vocab_size,
        target_num_layers=target.num_layers,
        rope_theta=float(theta),
        target=target_name(target),
    )


def target_name(target: HeadTarget) -> str:
    """What a target is called in checkpoint configs and their errors: a packaged model's key (which
    finds its bundled heads, whatever this machine's cache folder), any other model's folder."""
    return target.key if packaged_name(target.key) or target.folder is None else str(target.folder)


def sizes_of(target: HeadTarget) -> TargetSizes:
    """A loaded target's sizes, as a head is checked against them before its weights load."""
    return TargetSizes(target_name(target), target.vocab_size, target.hidden_size, target.num_layers)


def check_checkpoint(directory: str | Path, target: TargetSizes | None, kind: str, parse: Callable[[dict], Any],
                     build: Callable[[Any], nn.Module], label: str | None = None) -> Any:
    """What ``load_checkpoint`` checks before it reads any weight, against a target that need not
    be loaded: the files exist, config.json reads and holds the ``kind`` section, the head's sizes
    are the target's (None: no target to compare, as for an export), and the weight file's header
    lists exactly the tensors, of the shapes, the head built from the config has. Returns the
    parsed config; ValueError or FileNotFoundError naming the checkpoint otherwise."""
    label = label or kind.upper()
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(f"{directory} holds no {label} checkpoint (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    if target is not None and target.hidden_size is None:
        raise ValueError(f"the {label} head at {directory} drafts from the target's hidden states, and {target.name} "
                         f"has none; use a model target (target=smollm2 or target=hf)")
    try:
        raw = json.loads(config_path.read_text())
        if not isinstance(raw, dict) or kind not in raw:
            raise ValueError(f"{CONFIG_FILE} has no {kind!r} section")
        config = parse(raw[kind])
        shapes = weight_shapes(weights_path)
    except Exception as error:  # corrupt JSON, missing keys, a truncated or foreign weight file
        raise ValueError(f"the {label} checkpoint at {directory} is corrupt or incomplete: {error}") from error
    mismatches = [
        f"{name}: checkpoint {mine}, target {theirs}"
        for name, mine, theirs in [
            ("hidden size", config.hidden_size, target and target.hidden_size),
            ("vocabulary", config.vocab_size, target and target.vocab_size),
            ("layers", config.target_num_layers, target and target.num_layers),
        ]
        if target is not None and mine != theirs
    ]
    if mismatches:
        raise ValueError(
            f"the {label} checkpoint at {directory} was trained for another target "
            f"({config.target or 'unknown'}), not for this one ({target.name}): " + "; ".join(mismatches)
        )
    try:
        with torch.device("meta"):  # shapes only: nothing is allocated
            expected = {name: tuple(t.shape) for name, t in build(config).state_dict().items()}
    except (RuntimeError, ValueError, TypeError) as error:
        raise ValueError(f"the {label} checkpoint at {directory} has a config no head is built from: {error}") from error
    wrong = [f"{name} is {list(shapes[name])}, the config's {list(shape)}"
             for name, shape in expected.items() if name in shapes and shapes[name] != shape]
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if wrong or missing or unexpected:
        found = wrong + [f"missing {', '.join(missing)}"] * bool(missing) + [f"unexpected {', '.join(unexpected)}"] * bool(unexpected)
        raise ValueError(f"the {label} checkpoint at {directory} does not match its config: {'; '.join(found)}")
    return config


def load_checkpoint(directory: str | Path, target: HeadTarget, kind: str, parse: Callable[[dict], Any],
                    build: Callable[[Any], nn.Module], label: str | None = None) -> nn.Module:
    """Load any head written by ``save_head(..., kind=kind)`` (EAGLE, MTP, Medusa, Domino):
    ``parse`` turns its JSON config into a config (with hidden_size, vocab_size, target_num_layers
    and target fields), ``build`` makes the module. Clear errors for a missing, foreign or corrupt
    checkpoint (check_checkpoint, before the weights are read); a foreign one names both targets."""
    config = check_checkpoint(directory, sizes_of(target), kind, parse, build, label)
    try:
        head = build(config)
        head.load_state_dict(read_weights(Path(directory) / WEIGHTS_FILE))
    except Exception as error:  # a file changed since the check, or values the header did not show
        raise ValueError(f"the {label or kind.upper()} checkpoint at {directory} does not load: {error}") from error
    return head.to(device=target.device, dtype=target.dtype).eval()


def checkpoint_check(kind: str, parse: Callable[[dict], Any], build: Callable[[Any], nn.Module], bundled: str,
                     method: str, label: str | None = None) -> Callable[[Mapping[str, Any], TargetSizes], None]:
    """A head drafter's check before the target loads (drafters.base.register's ``check``): its
    ``checkpoint`` option's folder, or the bundled head's, through check_checkpoint."""
    def check(options: Mapping[str, Any], target: TargetSizes) -> None:
        check_checkpoint(options.get("checkpoint") or bundled_checkpoint(bundled, method, target.name), target, kind, parse,
                         build, label)

    return check
