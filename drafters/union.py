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

**Adaptive union** (``adaptive=true``, with ``costs``): which member pays differs by request (code
and summaries copy their context, chat does not) and drifts along an answer, so each request
corrects its members' P from its own recent outcomes. A node's base P0 is its member's calibrated
P when a table fits that member (tables are matched member by member: a member's acceptance does
not depend on the others, whose nodes never change the distribution of what the target emits),
else the member's own confidence (clamped to [0, 1]), else ``prior``. Per request, member m and
depth d, the union keeps two exponentially decayed sums over m's nodes at depth d: H, the nodes
that the target's text confirmed, and E, the sum of their P0. At each step that resolves some of
those nodes, both are multiplied by ``decay`` and the step's outcomes added; the node's P is then
min(1, P0 (H + w) / (E + w)), w = ``prior_weight`` (so P = P0 before any evidence, and for a
member with neither table nor confidence P = (H + w) / (N + w / prior) over its N recent nodes).
The budgeted merge above then keeps nodes by these P: a member that stops paying in a request
loses its nodes there, and one that starts paying regains them.

Every candidate is labelled, kept or not, by whether its path is what the target went on to
commit (resolved over later steps for a path longer than the step's output). For a kept node that
is exactly "accepted"; for a dropped one it is what would have happened had it been kept, since a
deterministic node is accepted iff the target's text continues through it, and that text's
distribution does not depend on the tree (exactness). So the feedback is full-information, not a
bandit's: a member whose nodes are all dropped still earns them back without exploration.

Exactness: the tree verified at step t is a function of the request's committed tokens up to
step t's root and of the outcomes of steps before t (all read in ``commit`` of those steps,
after their verification); it is chosen before step t's coins are drawn and does not depend on
them. For any such tree the point-mass rule emits step t's tokens from the target's conditional
distribution given the committed prefix, whatever the past coins that shaped the tree, so by
induction over steps the output is the target's (tests/test_union_adaptive.py; at T = 1,
tests/test_exactness.py). In fact the past outcomes add nothing beyond the text: with point-mass
nodes a step accepts the longest kept path that its committed tokens continue through (a rejected
node's token has no mass left), so every step's length and every label follow from the committed
text, and each tree is a function of the request's own text, as any deterministic drafter's is. A
request's state is its own (kept per batch row through reset, admit and retain), so its drafts
never depend on its batch neighbours. ``report`` (results.json
``drafter_report``) adds per member, over every request decoded (warm-up passes included): nodes
proposed, kept (verified) and accepted, and the spread over requests of the member's share of
each request's verified nodes.
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
from drafters.heads import BUNDLED, packaged_name
from specdec.protocols import Target, emitted_tokens
from specdec.speedup import load_profile, profile_forward
from specdec.tree import token_trie


def calibration_paths(packaged: str) -> tuple[Path, ...]:
    """Where a packaged target's tables are bundled, one per temperature they were fitted at (0 and 1)."""
    return tuple(BUNDLED / f"union-calibration-{packaged}{suffix}.json" for suffix in ("", "-t1"))


DEFAULT_CALIBRATIONS = calibration_paths("smollm2")  # where experiments/calibrate_union.py writes by default
CALIBRATED_DEPTHS = 4  # deeper nodes share depth 4's table


class Calibration:
    """P(accepted) of a member's node from its depth and raw confidence: a table per member and
    depth over fixed confidence bins, non-decreasing in confidence (experiments/calibrate_union.py)."""

    def __init__(self, edges: list[float], accept: list[list[list[float]]], temperature: float) -> None:
        self.edges, self.accept = [float(edge) for edge in edges], accept
        self.temperature = temperature  # the sampling temperature the acceptances were recorded at

    @classmethod
    def load(cls, path: str | Path, members: Sequence[Mapping], by_member: bool = False) -> Calibration:
        """The table fitted for exactly ``members``; with ``by_member``, each member's own table from
        a file fitted for any members that include one with the same options (None for the others)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no union calibration at {path}; fit one with python -m experiments.calibrate_union")
        raw = json.loads(path.read_text())
        wanted = [json.loads(json.dumps(dict(m), default=list)) for m in members]  # as JSON holds them
        if by_member:
            fitted = {json.dumps(m, sort_keys=True): table for m, table in zip(raw["members"], raw["accept"])}
            accept = [fitted.get(json.dumps(m, sort_keys=True)) for m in wanted]
            return cls(raw["edges"], accept, float(raw.get("temperature", 0.0)))
        if raw["members"] != wanted:
            raise ValueError(
                f"the calibration {path} was fitted for members {raw['members']}, not {wanted}; "
                f"fit one for these members with python -m experiments.calibrate_union"
            )
        return cls(raw["edges"], raw["accept"], float(raw.get("temperature", 0.0)))

    def fits(self, member: int) -> bool:
        return self.accept[member] is not None

    def probability(self, member: int, depth: int, confidence: float) -> float:
        return self.accept[member][min(depth, CALIBRATED_DEPTHS) - 1][confidence_bin(self.edges, confidence)]


def bundled_calibrations(target: Target) -> list[Path]:
    """The tables bundled for ``target`` (drafters/checkpoints/union-calibration-<packaged model>*.json),
    fitted on that model: another target's acceptance would start its nodes from the wrong P. None
    for a target without them (an adaptive union then starts from its members' confidence)."""
    packaged = packaged_name(target.key)
    return [path for path in calibration_paths(packaged) if path.is_file()] if packaged else []


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


Node = tuple[int, tuple[int, ...], float]  # (member, token path from the root, confidence)


@dataclasses.dataclass
class RequestState:
    """One request's state in an adaptive union (module docstring): per member and depth, the
    decayed sums H (nodes the target's text confirmed) and E (their P0), the nodes whose outcome
    the committed text has not settled yet, and counts for the report."""

    hits: list[list[float]]  # [member][depth - 1]: H
    expected: list[list[float]]  # [member][depth - 1]: E
    open: list[tuple[int, int, float, tuple[int, ...]]]  # (member, depth, P0, its tokens not yet committed)
    proposed: list[int]  # per member: candidate nodes
    kept: list[int]  # per member: nodes in the verified tree (a node two members drafted counts for both)
    accepted: list[int]  # per member: verified nodes on the accepted path
    verified: int = 0  # nodes of the verified trees

    @classmethod
    def fresh(cls, members: int, depths: int) -> RequestState:
        return cls([[0.0] * depths for _ in range(members)], [[0.0] * depths for _ in range(members)], [],
                   [0] * members, [0] * members, [0] * members)


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
        adaptive: bool = False,
        decay: float = 0.8,
        prior: float = 0.5,
        prior_weight: float = 1.0,
    ) -> None:
        """members: each a drafter config, {"name": ..., its options}, as in configs/drafter/.
        costs: None = verify every member's nodes; else the budgeted merge (module docstring) with
            T(n)/T(1) from "measure", a T(n) CSV (benchmarks/bench_target.py --out) or a list;
        draft_cost: c, the members' drafting time per step in target forwards T(1);
        calibration: the budgeted merge's tables (a path or several; each step uses the one fitted
            nearest its temperature; None = the tables bundled for the target: SmolLM2's for T = 0
            and T = 1, none for another). An adaptive union takes each member's table from any of
            them fitted for a member with the same options, and runs without one for the others
            ([] = no table at all);
        max_rows: the most rows (root included) a budgeted tree may have;
        cost_batch: the batch size whose T(n) prices the trees (specdec-run passes its batch_size);
        record: keep (member, depth, confidence, accepted) for every drafted node in ``records``
            (experiments/calibrate_union.py); needs costs=None, so every node gets verified;
        adaptive: correct each node's P by its member's recent outcomes in the same request (module
            docstring); needs costs. Its options: decay, the weight of a step's outcomes at the
            next step that settles more of that member's nodes at that depth (1 = never forget);
            prior, P0 of a node whose member has neither a fitting table nor a confidence;
            prior_weight, w, the prior's weight in expected accepted nodes."""
        if len(members) < 2:
            raise ValueError(f"a union needs at least two members; got {len(members)}")
        if record and costs is not None:
            raise ValueError("record=true labels every drafted node, which needs every node verified: set costs=null")
        if adaptive and costs is None:
            raise ValueError("adaptive=true chooses each request's nodes by the budgeted merge, which needs costs (e.g. costs=measure)")
        if not (0.0 <= decay <= 1.0 and 0.0 < prior <= 1.0 and prior_weight > 0.0):
            raise ValueError(f"need 0 <= decay <= 1, 0 < prior <= 1 and prior_weight > 0; got {decay}, {prior}, {prior_weight}")
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
        self.adaptive = adaptive
        self.calibrations: list[Calibration] = []
        if self.budgeted:
            if max_rows < 2 or draft_cost < 0 or cost_batch < 1:
                raise ValueError(
                    f"need max_rows >= 2, draft_cost >= 0 and cost_batch >= 1; got {max_rows}, {draft_cost}, {cost_batch}"
                )
            self.costs = relative_costs(costs, target, max_rows, cost_batch)
            self.draft_cost = draft_cost
            if calibration is None:
                paths = bundled_calibrations(target)
            else:
                paths = [calibration] if isinstance(calibration, (str, Path)) else list(calibration)
            if not paths and not adaptive:
                raise ValueError("a budgeted union needs a calibration table (none is bundled for this target): fit one with "
                                 "python -m experiments.calibrate_union and pass drafter.calibration=<it>, or set "
                                 "drafter.adaptive=true, which can run without one")
            self.calibrations = [Calibration.load(path, members, by_member=adaptive) for path in paths]
        # for results.json: a measured T(n) moves the budget, so runs differ in their trees (and tau)
        self._report = {"costs": self.costs, "draft_cost": self.draft_cost, "cost_batch": cost_batch} if self.budgeted else {}
        self.records: list[tuple[int, int, float, bool]] | None = [] if record else None
        self._pending: list[list[Node]] = []  # per request: this step's candidates (member, path, confidence)
        if adaptive:
            self.decay, self.prior, self.prior_weight = decay, prior, prior_weight
            self._depths = max_rows - 1  # no kept node lies deeper
            self._states: list[RequestState] = []  # per batch row
            self._bases: list[list[float]] = []  # per request: P0 of each of _pending's nodes
            self._totals = RequestState.fresh(len(self.members), 0)  # every request's counts, for the report
            self._shares: list[list[float]] = [[] for _ in self.members]  # per member: its share of each finished request's verified nodes

    @property
    def report(self) -> dict:
        """What specdec-run records in results.json as drafter_report (module docstring)."""
        if not self.adaptive:
            return self._report
        members = [
            {"name": name, "proposed": self._totals.proposed[m], "kept": self._totals.kept[m],
             "accepted": self._totals.accepted[m], "kept_share": spread(self._shares[m])}
            for m, (name, _) in enumerate(self.members)
        ]
        tables = [any(table.fits(m) for table in self.calibrations) for m in range(len(self.members))]
        adaptive = {"decay": self.decay, "prior": self.prior, "prior_weight": self.prior_weight, "tables": tables,
                    "members": members}
        return {**self._report, "adaptive": adaptive}

    def quantizable(self) -> list[nn.Module]:
        return [module for _, drafter in self.members for module in drafter.quantizable()]

    def reset(self, batch_size: int, max_length: int) -> None:
        for _, drafter in self.members:
            drafter.reset(batch_size, max_length)
        if self.adaptive:
            self._states = [RequestState.fresh(len(self.members), self._depths) for _ in range(batch_size)]

    def admit(self, count: int, max_length: int) -> None:
        for _, drafter in self.members:
            drafter.admit(count, max_length)
        if self.adaptive:
            self._states += [RequestState.fresh(len(self.members), self._depths) for _ in range(count)]

    def retain(self, rows: Tensor) -> None:
        for _, drafter in self.members:
            drafter.retain(rows)
        if self.adaptive:
            kept = rows.tolist()
            for row in sorted(set(range(len(self._states))) - set(kept)):  # finished requests
                state = self._states[row]
                if state.verified:
                    for m, shares in enumerate(self._shares):
                        shares.append(state.kept[m] / state.verified)
            self._states = [self._states[row] for row in kept]

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        for _, drafter in self.members:  # none of them reads the tree (checked at construction)
            drafter.commit(tree, result)
        if self.records is None and not self.adaptive:
            return
        emitted = emitted_tokens(tree, result).tolist()
        accepted = result.num_accepted.tolist()
        if self.records is not None:
            for request, nodes, count in zip(emitted, self._pending, accepted):
                # a node is accepted iff its path is a prefix of what was accepted
                for member, path, confidence in nodes:
                    hit = len(path) <= count and list(path) == request[: len(path)]
                    self.records.append((member, len(path), confidence, hit))
        if self.adaptive:
            verified = node_paths(tree)  # after the loop's pruning: what was verified
            for b, state in enumerate(self._states):
                text = emitted[b][: accepted[b] + 1]  # what this step committed after the root
                self._learn(state, self._pending[b], self._bases[b], {path for path, _ in verified[b]}, tuple(text))

    def _learn(self, state: RequestState, nodes: list[Node], bases: list[float], verified: set[tuple[int, ...]],
               text: tuple[int, ...]) -> None:
        """One request's step: count its nodes, then settle every open node against ``text``, the
        tokens committed after the root (each node's path starts at the root of the step that
        proposed it, and each step's text continues the last one's)."""
        state.verified += len(verified)
        self._totals.verified += len(verified)
        for (member, path, _), base in zip(nodes, bases):
            kept = path in verified
            hit = kept and path == text[: len(path)] and len(path) < len(text)  # the last token is the target's own
            for counts in (state, self._totals):
                counts.proposed[member] += 1
                counts.kept[member] += kept
                counts.accepted[member] += hit
            state.open.append((member, len(path), base, path))
        settled: dict[tuple[int, int], list[float]] = {}  # (member, depth slot) -> [hits, P0 sum]
        still_open = []
        for member, depth, base, rest in state.open:
            known = min(len(rest), len(text))
            if rest[:known] == text[:known] and known < len(rest):
                still_open.append((member, depth, base, rest[known:]))  # on course so far: later text decides
                continue
            sums = settled.setdefault((member, min(depth, self._depths) - 1), [0.0, 0.0])
            sums[0] += rest[:known] == text[:known]
            sums[1] += base
        state.open = still_open
        for (member, slot), (hits, expected) in settled.items():
            state.hits[member][slot] = self.decay * state.hits[member][slot] + hits
            state.expected[member][slot] = self.decay * state.expected[member][slot] + expected

    def observe(self, tree: DraftTree, logits: Tensor, result: VerifyResult) -> None:
        for _, drafter in self.members:  # the union's tree: members find their nodes by token path
            drafter.observe(tree, logits, result)

    def propose(self, ctx: DraftContext) -> DraftTree:
        candidates: list[list[Node]] = [[] for _ in range(ctx.tokens.shape[0])]
        scored = []  # per member: whether it gave a confidence per node
        for m, ((name, drafter), layers) in enumerate(zip(self.members, self._layer_index)):
            own = dataclasses.replace(ctx, new_hidden=tuple(ctx.new_hidden[i] for i in layers))
            tree = drafter.propose(own)
            if tree.mode is not SiblingMode.DETERMINISTIC:
                raise ValueError(
                    f"union member {name!r} drafted a {tree.mode.value} tree; a union merges deterministic "
                    f"drafts only (set the member's sampling=deterministic)"
                )
            if ((self.budgeted and not self.adaptive) or self.records is not None) and tree.confidence is None:
                raise ValueError(
                    f"union member {name!r} gives no confidence per node, which a budgeted or recording union "
                    f"needs (members that give one: eagle, eagle2, eagle3, medusa, mtp, domino, ngram, retrieval; "
                    f"an adaptive union, adaptive=true, takes members without one)"
                )
            scored.append(tree.confidence is not None)
            for request, nodes in zip(candidates, node_paths(tree)):
                request.extend((m, path, confidence) for path, confidence in nodes)
        self._pending = candidates
        if not self.budgeted:
            drafts = [[list(path) for _, path, _ in nodes] for nodes in candidates]
            return token_trie(drafts, ctx.tokens.device)
        temperature = ctx.sampling.temperature
        nearest = lambda tables: min(tables, key=lambda table: abs(table.temperature - temperature), default=None)
        if not self.adaptive:
            calibration = nearest(self.calibrations)
            drafts, scores = zip(*(self._budget(nodes, calibration) for nodes in candidates))
            return token_trie(list(drafts), ctx.tokens.device, list(scores))
        tables = [nearest([table for table in self.calibrations if table.fits(m)]) if scored[m] else None
                  for m in range(len(self.members))]
        self._bases = [[self._base(tables, scored, *node) for node in nodes] for nodes in candidates]
        kept = [self._budget(nodes, probabilities=[min(1.0, base * self._factor(state, member, len(path)))
                                                   for (member, path, _), base in zip(nodes, bases)])
                for nodes, bases, state in zip(candidates, self._bases, self._states)]
        drafts, scores = zip(*kept)
        return token_trie(list(drafts), ctx.tokens.device, list(scores))

    def _base(self, tables: list[Calibration | None], scored: list[bool], member: int, path: tuple[int, ...],
              confidence: float) -> float:
        """P0: the member's calibrated P, else its own confidence, else the prior."""
        if tables[member] is not None:
            return tables[member].probability(member, len(path), confidence)
        return min(max(confidence, 0.0), 1.0) if scored[member] else self.prior

    def _factor(self, state: RequestState, member: int, depth: int) -> float:
        """(H + w) / (E + w) of the member's nodes at this depth in this request."""
        slot = min(depth, self._depths) - 1
        return (state.hits[member][slot] + self.prior_weight) / (state.expected[member][slot] + self.prior_weight)

    def _budget(
        self, nodes: list[Node], calibration: Calibration | None = None, probabilities: Sequence[float] | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One request's kept node paths, likeliest first, with their P as confidence: P from
        ``probabilities`` (one per node, as the adaptive union gives them), else from ``calibration``."""
        if probabilities is None:
            probabilities = [calibration.probability(member, len(path), confidence) for member, path, confidence in nodes]
        chance: dict[tuple[int, ...], float] = {}
        for (_, path, _), p in zip(nodes, probabilities):
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


def spread(values: list[float]) -> dict[str, float | int]:
    """How many values, and their 10th, 50th and 90th percentiles (nearest rank), for the report."""
    ordered = sorted(values)
    at = lambda q: round(ordered[int(q * (len(ordered) - 1) + 0.5)], 4) if ordered else None
    return {"requests": len(ordered), "p10": at(0.1), "median": at(0.5), "p90": at(0.9)}


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
