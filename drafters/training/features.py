"""Target features on disk: extracted once, shared by every head and every run.

A cache is a folder of shards. Each shard is one safetensors file holding, for a group of training
sequences, the tokens (int32 [T]), the sequence offsets (int64 [S+1]) and one float16 [T, H] matrix
per stored target layer (HFTarget indices: 0 = embeddings, k = block k, L+1 = final-norm output).
Shards are written atomically, so a killed extraction resumes at the first missing shard, and
safetensors maps them from disk instead of loading gigabytes into memory. When the final-norm output
is stored, each shard is labelled with the target's argmax choices (choices/) as it is written, so
trainings started together on a fresh cache do not each compute the same labels before their first
step.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from specdec.protocols import HeadTarget

META = "meta.json"


@dataclass(frozen=True)
class CacheMeta:
    model: str  # what the features came from (checked when a head is trained on them)
    hidden_size: int
    num_layers: int
    vocab_size: int
    layers: tuple[int, ...]
    max_length: int  # tokens per sequence, at most
    sequences_per_shard: int


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def extract_features(
    target: HeadTarget,
    sequences: Sequence[list[int]],
    directory: str | Path,
    meta: CacheMeta,
    batch_size: int = 4,
    progress: Callable[[int, int, float], None] | None = None,  # (tokens done, total, tokens/s extracted)
) -> Path:
    """Write the features of ``sequences`` (already truncated to meta.max_length) into ``directory``,
    skipping shards that exist, and label every shard that has no labels for this target's LM head.
    The same meta must be passed when resuming."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_or_check_meta(directory, meta)
    final_layer = meta.num_layers + 1
    lm_head = target.model.get_output_embeddings().weight.detach() if final_layer in meta.layers else None
    fingerprint = lm_head_fingerprint(lm_head, final_layer) if lm_head is not None else None
    total = sum(len(s) for s in sequences)
    done, extracted, start = 0, 0, time.perf_counter()  # shards already there count as done, not in the rate
    per_shard = meta.sequences_per_shard
    for index, first in enumerate(range(0, len(sequences), per_shard)):
        group = sequences[first : first + per_shard]
        path = directory / shard_name(index)
        if not path.exists():
            tensors = _shard_tensors(target, group, meta.layers, batch_size)
            with tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp", delete=False) as f:
                temporary = f.name
            try:
                save_file(tensors, temporary)
                os.replace(temporary, path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
            extracted += sum(len(s) for s in group)
        if lm_head is not None:
            label_shard(path, lm_head, final_layer, fingerprint)
        done += sum(len(s) for s in group)
        if progress:
            progress(done, total, extracted / max(time.perf_counter() - start, 1e-9))
    return directory


def _shard_tensors(target: HeadTarget, group: Sequence[list[int]], layers: tuple[int, ...], batch_size: int) -> dict:
    features: dict[int, list[Tensor]] = {k: [] for k in layers}
    for first in range(0, len(group), batch_size):
        batch = group[first : first + batch_size]
        # a trailing dummy token makes prefill return the features of every real token
        prompts = [torch.tensor(list(s) + [0], dtype=torch.int64) for s in batch]
        out = target.prefill(prompts, layers)
        for k, hidden in zip(layers, out.hidden):
            features[k] += [hidden[i, : len(s)].to(torch.float16).cpu() for i, s in enumerate(batch)]
    lengths = torch.tensor([len(s) for s in group])
    tensors = {
        "tokens": torch.tensor([t for s in group for t in s], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
    }
    tensors.update({f"layer_{k}": torch.cat(features[k]).contiguous() for k in layers})
    return tensors


def _write_or_check_meta(directory: Path, meta: CacheMeta) -> None:
    path = directory / META
    if path.exists():
        existing = json.loads(path.read_text())
        if existing != json.loads(json.dumps(asdict(meta))):
            raise ValueError(
                f"{directory} holds features of another configuration ({existing}); "
                f"use a new directory or the same settings ({asdict(meta)})"
            )
        return
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as f:
        json.dump(asdict(meta), f, indent=2)
    os.replace(f.name, path)


@dataclass(frozen=True)
class FeatureSequence:
    tokens: Tensor  # [T] int64
    features: dict[int, Tensor]  # layer -> [T, H] float16, row t = state after reading token t


class FeatureCache:
    """Read side: iterate the sequences of every complete shard (memory-mapped)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        path = self.directory / META
        if not path.exists():
            raise FileNotFoundError(f"no feature cache at {self.directory} (missing {META}); extract it first")
        raw = json.loads(path.read_text())
        raw["layers"] = tuple(raw["layers"])
        self.meta = CacheMeta(**raw)
        self.shards = sorted(self.directory.glob("shard-*.safetensors"))
        if not self.shards:
            raise ValueError(f"the feature cache at {self.directory} has no complete shard yet")

    def sequences(self, layers: Sequence[int], shards: Sequence[int] | None = None) -> Iterator[FeatureSequence]:
        from safetensors import safe_open

        missing = [k for k in layers if k not in self.meta.layers]
        if missing:
            raise ValueError(f"layers {missing} are not in the feature cache (it has {self.meta.layers})")
        for index in shards if shards is not None else range(len(self.shards)):
            with safe_open(str(self.shards[index]), framework="pt") as f:
                tokens, offsets = f.get_tensor("tokens").long(), f.get_tensor("offsets")
                matrices = {k: f.get_tensor(f"layer_{k}") for k in layers}
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
                yield FeatureSequence(tokens[a:b], {k: m[a:b] for k, m in matrices.items()})

    def target_choices(self, shards: Sequence[int], lm_head: Tensor, final_layer: int) -> Tensor:  # [T] int64
        """The target's argmax next-token choice at every token of ``shards``, in order (see
        label_shard); the LM head's fingerprint (a pass over its weights) is taken once for all."""
        fingerprint = lm_head_fingerprint(lm_head, final_layer)
        return torch.cat([label_shard(self.shards[i], lm_head, final_layer, fingerprint) for i in shards])

    def num_tokens(self) -> int:
        from safetensors import safe_open

        total = 0
        for shard in self.shards:
            with safe_open(str(shard), framework="pt") as f:
                total += int(f.get_slice("tokens").get_shape()[0])
        return total


def lm_head_fingerprint(lm_head: Tensor, final_layer: int) -> str:
    """Names the LM head labels came from (shape and checksum), so another head's labels are recomputed."""
    return f"{tuple(lm_head.shape)}:{float(lm_head.double().sum()):.10e}:{final_layer}"


def label_shard(shard: Path, lm_head: Tensor, final_layer: int, fingerprint: str) -> Tensor:  # [T] int64
    """The target's argmax next-token choice at every token of ``shard``, from its stored (float16)
    final-norm features; computed once and kept beside the shard (choices/), because on a CPU the
    vocabulary-sized product costs minutes per training run. Extraction and training both come
    here, so labels made at extraction are the ones a training would compute."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = shard.parent / "choices" / shard.name
    if path.exists():
        with safe_open(str(path), framework="pt") as f:
            if f.metadata().get("lm_head") == fingerprint:
                return f.get_tensor("choices").long()
    with safe_open(str(shard), framework="pt") as f:
        final = f.get_tensor(f"layer_{final_layer}")
    with torch.no_grad():
        choices = torch.cat([(chunk.float() @ lm_head.float().T).argmax(-1) for chunk in final.split(4096)])
    path.parent.mkdir(exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
        temporary = f.name
    try:
        save_file({"choices": choices.to(torch.int32)}, temporary, metadata={"lm_head": fingerprint})
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return choices
