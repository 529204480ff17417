"""Several drafters' proposals verified as one tree (``union``): for example EAGLE-3's top
candidates plus the request's own n-gram continuation, which catches repeated spans the head
misses at the price of a few more verified rows.

Every member proposes from the same DraftContext (restricted to the target layers it asked for);
their trees are merged into one DETERMINISTIC token trie, members in order, so a continuation that
two members drafted is verified once. Merging is exact for deterministic drafts only (a point-mass
q per node, any sibling order), so a member that samples its drafts is refused at its first
proposal. Members whose state follows what their own tree accepted (``commit_reads_tree``: a draft
model's or layer skip's own KV cache) cannot be told what another member's accepted branch was,
and are refused up front; every other drafter rebuilds what it needs from the next DraftContext.

**Budgeted merge** (``costs`` set): instead of verifying every member's nodes, each request keeps
the nodes that maximise expected tokens per unit of time. A node's acceptance probability P comes
from its member's own confidence (``DraftTree.confidence``) through a calibration table (per
member and depth, fitted on recorded acceptances by experiments/calibrate_union.py at one
temperature, since acceptance falls with T; each step uses the table fitted nearest its
temperature, and SmolLM2's are bundled for T = 0 and T = 1); a node two members drafted takes the
larger P, and no node scores above its parent. With nodes ranked by P,
the request keeps the k best, for the k that maximises (1 + sum of their P) / (T(k + 1) / T(1) + c):
a tree of k nodes verifies k + 1 rows, and c is the drafting cost in target forwards. On a
machine where T(n) jumps (a few rows more can cost a fraction of a forward more), this keeps extra
members' nodes for the steps where they are likely enough to pay. Costs are per request, from T(n) at
``cost_batch`` requests of n rows each (``${batch_size}``, the run's, in configs/drafter/): a wider
batch meets T(n)'s jumps (a GEMM chunk filled) at fewer rows per request, so trees priced at batch
1 would make a wider batch pay jumps that batch 1 never meets (docs/RESULTS.md, "Tree budgets at
the batch's T(n)"). A request's tree still depends only on its own
context and the fixed table, never on its neighbours; a batch verifies its widest tree for every
request. With ``costs=measure`` the trees follow the T(n) timed at start, so two runs can draft
differently (and differ in tau, never in exactness); specdec-run records the costs in
results.json (``drafter_report``).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import Tensor, nn

from drafters.base import DraftContext, DraftTree, DrafterBase, SiblingMode, VerifyResult, build, register
from specdec.protocols import Target, emitted_tokens
from specdec.speedup import load_profile, profile_forward
from specdec.tree import token_trie

# the bundled SmolLM2 tables, one per temperature they were fitted at (0 and 1)
DEFAULT_CALIBRATIONS = tuple(Path(__file__).parent / "checkpoints" / f"union-calibration-smollm2{suffix}.json"
                             for suffix in ("", "-t1"))
CALIBRATED_DEPTHS = 4  # deeper nodes share depth 4's table


class Calibration:
    """P(accepted) of a member's node from its depth and raw confidence: a table per member and
    depth over fixed confidence bins, non-decreasing in confidence (experiments/calibrate_union.py)."""

    def __init__(self, edges: list[float], accept: list[list[list[float]]], temperature: float) -> None:
        self.edges, self.accept = [float(edge) for edge in edges], accept
        self.temperature = temperature  # the sampling temperature the acceptances were recorded at

    @classmethod
    def load(cls, path: str | Path, members: Sequence[Mapping]) -> Calibration:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no union calibration at {path}; fit one with python -m experiments.calibrate_union")
        raw = json.loads(path.read_text())
        wanted = [json.loads(json.dumps(dict(m), default=list)) for m in members]  # as JSON holds them
        if raw["members"] != wanted:
            raise ValueError(
                f"the calibration {path} was fitted for members {raw['members']}, not {wanted}; "
                f"fit one for these members with python -m experiments.calibrate_union"
            )
        return cls(raw["edges"], raw["accept"], float(raw.get("temperature", 0.0)))

    def probability(self, member: int, depth: int, confidence: float) -> float:
        return self.accept[member][min(depth, CALIBRATED_DEPTHS) - 1][confidence_bin(self.edges, confidence)]


def confidence_bin(edges: Sequence[float], confidence: float) -> int:
    """The bin [edges[i], edges[i + 1]) holding ``confidence``, clamped to the first and last."""
    return min(max(bisect.bisect_right(edges, confidence) - 1, 0), len(edges) - 2)  # scalar: no numpy call


def relative_costs(costs, target: Target, max_rows: int, batch_size: int = 1) -> list[float]:
    """T(n) / T(1) for n = 1..max_rows at ``batch_size`` requests of n rows each, from a list, a T(n)
    CSV profile measured at that batch size, or "measure" (times the target)."""
    if costs == "measure":
        sizes = list(range(1, max_rows + 1))
        profile = profile_forward(target, sizes, context_length=128, repeats=5, batch_size=batch_size)
    elif isinstance(costs, (str, Path)):
        profile = load_profile(costs)
        if profile.batch_size != batch_size:
            raise ValueError(
                f"the T(n) profile {costs} was measured at batch {profile.batch_size}, but this union prices "
                f"trees at batch {batch_size} (cost_batch); measure one with python -m benchmarks.bench_target "
                f"--batch {batch_size} --out FILE, or set cost_batch={profile.batch_size}"
            )
    else:
        ratios = [float(c) for c in costs]
        if len(ratios) < max_rows or ratios[0] != 1.0 or any(b < a for a, b in zip(ratios, ratios[1:])):
            raise ValueError(
                f"costs must list T(n)/T(1) for n = 1..{max_rows} (max_rows), starting at 1.0 and never falling; got {ratios}"
            )
        return ratios[:max_rows]
    # a timed curve can dip by noise below an earlier point; more rows never cost less
    return list(itertools.accumulate((profile.time(n) / profile.time(1) for n in range(1, max_rows + 1)), max))


@register("union")
class UnionDrafter(DrafterBase):
    def __init__(
        self,
        target: Target,
        members: Sequence[Mapping],
        costs: str | Sequence[float] | None = None,
        draft_cost: float = 0.1,
        calibration: str | Sequence[str] | None = None,
        max_rows: int = 16,
        cost_batch: int = 1,
        record: bool = False,
    ) -> None:
        """members: each a drafter config, {"name": ..., its options}, as in configs/drafter/.
        costs: None = verify every member's nodes; else the budgeted merge (module docstring) with
            T(n)/T(1) from "measure", a T(n) CSV (benchmarks/bench_target.py --out) or a list;
        draft_cost: c, the members' drafting time per step in target forwards T(1);
        calibration: the budgeted merge's tables (a path or several; each step uses the one fitted
            nearest its temperature; None = the bundled SmolLM2 tables for T = 0 and T = 1);
        max_rows: the most rows (root included) a budgeted tree may have;
        cost_batch: the batch size whose T(n) prices the trees (specdec-run passes its batch_size);
        record: keep (member, depth, confidence, accepted) for every drafted node in ``records``
            (experiments/calibrate_union.py); needs costs=None, so every node gets verified."""
        if len(members) < 2:
            raise ValueError(f"a union needs at least two members; got {len(members)}")
        if record and costs is not None:
            raise ValueError("record=true labels every drafted node, which needs every node verified: set costs=null")
        self.members = []
        for member in members:
            options = dict(member)
            name = options.pop("name", None)
            if name is None or name == "union":
                raise ValueError(f"each union member needs the name of another drafter; got {dict(member)}")
            drafter = build(name, target, **options)
            if drafter.commit_reads_tree:
                raise ValueError(
                    f"drafter {name!r} keeps state from what its own tree accepted, which a union cannot "
                    f"report when another member's branch wins; use it on its own"
                )
            self.members.append((name, drafter))
        self.target_layers = tuple(sorted({k for _, d in self.members for k in d.target_layers}))
        # member -> where each of its layers sits in this union's new_hidden
        self._layer_index = [tuple(self.target_layers.index(k) for k in d.target_layers) for _, d in self.members]
        self.budgeted = costs is not None
        if self.budgeted:
            if max_rows < 2 or draft_cost < 0 or cost_batch < 1:
                raise ValueError(
                    f"need max_rows >= 2, draft_cost >= 0 and cost_batch >= 1; got {max_rows}, {draft_cost}, {cost_batch}"
                )
            self.costs = relative_costs(costs, target, max_rows, cost_batch)
            self.draft_cost = draft_cost
            if calibration is None:
                paths = DEFAULT_CALIBRATIONS
            else:
                paths = [calibration] if isinstance(calibration, (str, Path)) else list(calibration)
            self.calibrations = [Calibration.load(path, members) for path in paths]
        # for results.json: a measured T(n) moves the budget, so runs differ in their trees (and tau)
        self.report = {"costs": self.costs, "draft_cost": self.draft_cost, "cost_batch": cost_batch} if self.budgeted else {}
        self.records: list[tuple[int, int, float, bool]] | None = [] if record else None
        self._pending: list[list[tuple[int, tuple[int, ...], float]]] = []  # per request: (member, path, confidence)

    def quantizable(self) -> list[nn.Module]:
        return [module for _, drafter in self.members for module in drafter.quantizable()]

    def reset(self, batch_size: int, max_length: int) -> None:
        for _, drafter in self.members:
            drafter.reset(batch_size, max_length)

    def admit(self, count: int, max_length: int) -> None:
        for _, drafter in self.members:
            drafter.admit(count, max_length)

    def retain(self, rows: Tensor) -> None:
        for _, drafter in self.members:
            drafter.retain(rows)

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        for _, drafter in self.members:  # none of them reads the tree (checked at construction)
            drafter.commit(tree, result)
        if self.records is not None:
            emitted = emitted_tokens(tree, result).tolist()
            for request, nodes, accepted in zip(emitted, self._pending, result.num_accepted.tolist()):
                # a node is accepted iff its path is a prefix of what was accepted
                for member, path, confidence in nodes:
                    hit = len(path) <= accepted and list(path) == request[: len(path)]
                    self.records.append((member, len(path), confidence, hit))

    def observe(self, tree: DraftTree, logits: Tensor, result: VerifyResult) -> None:
        for _, drafter in self.members:  # the union's tree: members find their nodes by token path
            drafter.observe(tree, logits, result)

    def propose(self, ctx: DraftContext) -> DraftTree:
        candidates: list[list[tuple[int, tuple[int, ...], float]]] = [[] for _ in range(ctx.tokens.shape[0])]
        for m, ((name, drafter), layers) in enumerate(zip(self.members, self._layer_index)):
            own = dataclasses.replace(ctx, new_hidden=tuple(ctx.new_hidden[i] for i in layers))
            tree = drafter.propose(own)
            if tree.mode is not SiblingMode.DETERMINISTIC:
                raise ValueError(
                    f"union member {name!r} drafted a {tree.mode.value} tree; a union merges deterministic "
                    f"drafts only (set the member's sampling=deterministic)"
                )
            if (self.budgeted or self.records is not None) and tree.confidence is None:
                raise ValueError(
                    f"union member {name!r} gives no confidence per node, which a budgeted or recording union "
                    f"needs (members that give one: eagle, eagle2, eagle3, medusa, mtp, domino, ngram, retrieval)"
                )
            for request, nodes in zip(candidates, node_paths(tree)):
                request.extend((m, path, confidence) for path, confidence in nodes)
        self._pending = candidates
        if not self.budgeted:
            drafts = [[list(path) for _, path, _ in nodes] for nodes in candidates]
            return token_trie(drafts, ctx.tokens.device)
        temperature = ctx.sampling.temperature
        calibration = min(self.calibrations, key=lambda table: abs(table.temperature - temperature))
        drafts, scores = zip(*(self._budget(nodes, calibration) for nodes in candidates))
        return token_trie(list(drafts), ctx.tokens.device, list(scores))

    def _budget(
        self, nodes: list[tuple[int, tuple[int, ...], float]], calibration: Calibration
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One request's kept node paths, likeliest first, with their calibrated P as confidence."""
        chance: dict[tuple[int, ...], float] = {}
        for member, path, confidence in nodes:
            p = calibration.probability(member, len(path), confidence)
            chance[path] = max(chance.get(path, 0.0), p)
        for path in sorted(chance, key=len):  # a member's tree holds every node's parent
            if len(path) > 1:
                chance[path] = min(chance[path], chance[path[:-1]])
        ranked = sorted(chance, key=lambda path: (-chance[path], len(path)))[: len(self.costs) - 1]
        best_rate, best_k, expected = 1.0 / (1.0 + self.draft_cost), 0, 1.0
        for k, path in enumerate(ranked, 1):
            expected += chance[path]
            rate = expected / (self.costs[k] + self.draft_cost)  # k nodes = k + 1 rows = costs[k]
            if rate > best_rate:
                best_rate, best_k = rate, k
        kept = ranked[:best_k]
        return [list(path) for path in kept], [[chance[path[:d]] for d in range(1, len(path) + 1)] for path in kept]


def node_paths(tree: DraftTree) -> list[list[tuple[tuple[int, ...], float]]]:
    """Per request, every node's token path from the root and its confidence (0 without one), host-side."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    confidence = tree.confidence.tolist() if tree.confidence is not None else None
    result = []
    for b, count in enumerate(tree.num_nodes.tolist()):
        paths: list[tuple[int, ...]] = []
        for i in range(count):
            parent = parents[b][i]
            paths.append((paths[parent] if parent >= 0 else ()) + (tokens[b][i],))
        result.append([(path, confidence[b][i] if confidence else 0.0) for i, path in enumerate(paths)])
    return result
