"""Target features on disk: extracted once, shared by every head and every run.

A cache is a folder of shards. Each shard is one safetensors file holding, for a group of training
sequences, the tokens (int32 [T]), the sequence offsets (int64 [S+1]) and one float16 [T, H] matrix
per stored target layer (HFTarget indices: 0 = embeddings, k = block k, L+1 = final-norm output);
a layer whose values pass float16's range is stored in bfloat16 instead (``storable``).
Shards are written atomically, so a killed extraction resumes with the missing shards, and
safetensors maps them from disk instead of loading gigabytes into memory. When the final-norm output
is stored, each shard is labelled with the target's argmax choices (choices/) as it is written, so
trainings started together on a fresh cache do not each compute the same labels before their first
step.

Under torchrun, extraction is sharded: process r of W extracts and labels shards r, r + W, r + 2W ...
into the same folder (one that every node shares). Shards are self-contained files named by index,
so a cache killed under one world size resumes under any other: each process skips what exists. The
round-robin split keeps that resume balanced, because the shards a killed run leaves behind form
(nearly) a prefix, which every world size splits evenly; contiguous ranges would leave one process
with all the missing work after a change of world size.
"""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import safetensors.torch
from safetensors import safe_open
from torch import Tensor

from specdec.files import write_atomically
from specdec.protocols import HeadTarget

META = "meta.json"


@dataclass(frozen=True)
class CacheMeta:
    model: str  # the target's key (specdec.target_loader: smollm2, or its model folder's name)
    hidden_size: int
    num_layers: int
    vocab_size: int
    layers: tuple[int, ...]
    max_length: int  # tokens per sequence, at most
    sequences_per_shard: int


def fused_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high blocks of an L-layer target (2, L/2, L-3), as its reference
    code and speculators pick them."""
    return (2, num_layers // 2, num_layers - 3)


def default_layers(num_layers: int, also: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The layers a new cache stores: EAGLE-3's fused blocks (``fused_layers``) and the final-norm
    output L+1 (EAGLE-1's feature, labelled), then ``also``; so one extraction serves every head,
    whichever tool (specdec-train or experiments.extract_features) made it."""
    return tuple(dict.fromkeys((*fused_layers(num_layers), num_layers + 1) + also))


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def extract_features(
    target: HeadTarget,
    sequences: Sequence[list[int]],
    directory: str | Path,
    meta: CacheMeta,
    batch_size: int = 4,
    progress: Callable[[int, int, float], None] | None = None,  # (tokens done, total, tokens/s extracted)
    distributed: bool = False,
) -> Path:
    """Write the features of ``sequences`` (already truncated to meta.max_length) into ``directory``,
    skipping shards that exist, and label every shard that has no labels for this target's LM head.
    The same meta must be passed when resuming.

    ``distributed``: every process of the initialised torch.distributed group calls this with the
    same arguments; each extracts and labels its own shards (see the module docstring), and all
    return once the whole cache is on disk. ``progress`` counts every process's shards (the ones
    in the folder), so passing it to one process is enough."""
    rank, world = _rank_and_world() if distributed else (0, 1)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if world > 1:
        _check_same_sequences(sequences, world)
    _write_or_check_meta(directory, meta)  # every process writes the same content atomically: no race
    final_layer = meta.num_layers + 1
    lm_head = target.model.get_output_embeddings().weight.detach() if final_layer in meta.layers else None
    fingerprint = lm_head_fingerprint(lm_head, final_layer) if lm_head is not None else None
    per_shard = meta.sequences_per_shard
    groups = [sequences[first : first + per_shard] for first in range(0, len(sequences), per_shard)]
    sizes = [sum(len(s) for s in group) for group in groups]
    total = sum(sizes)
    # shards already there count as done, not in the rate
    done = at_start = _tokens_on_disk(directory, sizes) if progress else 0
    start = time.perf_counter()
    for index in range(rank, len(groups), world):
        path = directory / shard_name(index)
        if not path.exists():
            _save_atomically(_shard_tensors(target, groups[index], meta.layers, batch_size), path)
        if lm_head is not None:
            label_shard(path, lm_head, final_layer, fingerprint)
        if progress:
            done = _tokens_on_disk(directory, sizes)
            progress(done, total, (done - at_start) / max(time.perf_counter() - start, 1e-9))
    if world > 1:
        dist.barrier()  # the others' shards are written too
        _check_complete(directory, len(groups), labelled=lm_head is not None)
        if progress and done < total:  # the last shards were the other processes'
            progress(total, total, (total - at_start) / max(time.perf_counter() - start, 1e-9))
    return directory


def _rank_and_world() -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("extract_features(distributed=True) needs the torch.distributed group torchrun describes; "
                         "call drafters.training.trainer.init_distributed() first, or pass distributed=False")
    return dist.get_rank(), dist.get_world_size()


def _check_same_sequences(sequences: Sequence[list[int]], world: int) -> None:
    """Every process must cut the same shards: compare a digest of the sequences before any work."""
    digest = hashlib.sha256()
    for s in sequences:
        digest.update(array("q", [len(s), *s]).tobytes())
    mine = (len(sequences), digest.hexdigest())
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if any(theirs != everyone[0] for theirs in everyone):
        counts = ", ".join(f"process {r}: {n}" for r, (n, _) in enumerate(everyone))
        raise ValueError(f"the processes were given different sequences ({counts} sequences, digests differ); every "
                         f"process must read the same data in the same order (same --sequences file or settings)")


def _tokens_on_disk(directory: Path, sizes: list[int]) -> int:
    present = {path.name for path in directory.glob("shard-*.safetensors")}
    return sum(size for index, size in enumerate(sizes) if shard_name(index) in present)


def _check_complete(directory: Path, num_shards: int, labelled: bool) -> None:
    wanted = [directory / shard_name(i) for i in range(num_shards)]
    if labelled:
        wanted += [directory / "choices" / shard_name(i) for i in range(num_shards)]
    missing = [str(path.relative_to(directory)) for path in wanted if not path.exists()]
    if missing:
        raise RuntimeError(f"{directory} lacks {len(missing)} files after every process finished (e.g. {missing[0]}); "
                           f"under torchrun across machines the cache folder must be one that all of them share")


def _save_atomically(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    # looked up at each call: tests/test_faults_data.py kills the process inside it
    write_atomically(path, lambda staged: safetensors.torch.save_file(tensors, str(staged), metadata=metadata))


def _shard_tensors(target: HeadTarget, group: Sequence[list[int]], layers: tuple[int, ...], batch_size: int) -> dict:
    features: dict[int, list[Tensor]] = {k: [] for k in layers}
    for first in range(0, len(group), batch_size):
        batch = group[first : first + batch_size]
        # a trailing dummy token makes prefill return the features of every real token
        prompts = [torch.tensor(list(s) + [0], dtype=torch.int64) for s in batch]
        out = target.prefill(prompts, layers)
        for k, hidden in zip(layers, out.hidden):
            features[k] += [hidden[i, : len(s)].float().cpu() for i, s in enumerate(batch)]
    lengths = torch.tensor([len(s) for s in group])
    tensors = {
        "tokens": torch.tensor([t for s in group for t in s], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
    }
    tensors.update({f"layer_{k}": storable(torch.cat(features[k])) for k in layers})
    return tensors


def storable(matrix: Tensor) -> Tensor:  # [T, H] float32 -> [T, H] float16 or bfloat16
    """float16 where every value fits it, else bfloat16: some models' residual streams pass float16's
    range (Gemma 3's middle layers reach 1e5), and an infinite feature trains a head to NaN."""
    half = matrix.to(torch.float16)
    return (half if bool(torch.isfinite(half).all()) else matrix.to(torch.bfloat16)).contiguous()


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
    write_atomically(path, lambda staged: staged.write_text(json.dumps(asdict(meta), indent=2)))


@dataclass(frozen=True)
class FeatureSequence:
    tokens: Tensor  # [T] int64
    features: dict[int, Tensor]  # layer -> [T, H] float16 or bfloat16 (one dtype), row t = state after reading token t


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
        missing = [k for k in layers if k not in self.meta.layers]
        if missing:
            raise ValueError(f"layers {missing} are not in the feature cache (it has {self.meta.layers})")
        for index in shards if shards is not None else range(len(self.shards)):
            with safe_open(str(self.shards[index]), framework="pt") as f:
                tokens, offsets = f.get_tensor("tokens").long(), f.get_tensor("offsets")
                matrices = {k: f.get_tensor(f"layer_{k}") for k in layers}
            if len({m.dtype for m in matrices.values()}) > 1:  # some layer passed float16's range: its wider dtype for all
                matrices = {k: m.to(torch.bfloat16) for k, m in matrices.items()}
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
                yield FeatureSequence(tokens[a:b], {k: m[a:b] for k, m in matrices.items()})

    def target_choices(self, shards: Sequence[int], lm_head: Tensor, final_layer: int) -> Tensor:  # [T] int64
        """The target's argmax next-token choice at every token of ``shards``, in order (see
        label_shard); the LM head's fingerprint (a pass over its weights) is taken once for all."""
        fingerprint = lm_head_fingerprint(lm_head, final_layer)
        return torch.cat([label_shard(self.shards[i], lm_head, final_layer, fingerprint) for i in shards])

    def num_tokens(self) -> int:
        total = 0
        for shard in self.shards:
            with safe_open(str(shard), framework="pt") as f:
                total += int(f.get_slice("tokens").get_shape()[0])
        return total


def lm_head_fingerprint(lm_head: Tensor, final_layer: int) -> str:
    """Names the LM head labels came from (shape and checksum), so another head's labels are recomputed."""
    return f"{tuple(lm_head.shape)}:{float(lm_head.double().sum()):.10e}:{final_layer}"


def label_shard(shard: Path, lm_head: Tensor, final_layer: int, fingerprint: str) -> Tensor:  # [T] int64
    """The target's argmax next-token choice at every token of ``shard``, from its stored (float16 or
    bfloat16) final-norm features; computed once and kept beside the shard (choices/), because on a CPU the
    vocabulary-sized product costs minutes per training run. Extraction and training both come
    here, so labels made at extraction are the ones a training would compute."""
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
    _save_atomically({"choices": choices.to(torch.int32)}, path, metadata={"lm_head": fingerprint})
    return choices
