"""What a benchmark runs: workload families x temperatures x answer lengths, one specdec-run per
combination (a cell), every drafter and peer a side of that run against the same plain decoding.

A family is a workload with its settings. A new family is one more entry in FAMILIES (its workload
registered in experiments/run/workloads.py); a new drafter worth ranking, one more name in
DRAFTERS.
"""

from __future__ import annotations

from dataclasses import dataclass

from experiments.run import peers as peer_registry


@dataclass(frozen=True)
class Family:
    name: str
    overrides: tuple[str, ...]  # specdec-run overrides that make the workload
    prompts: int | None  # workload.num_prompts in the full bench; None = the whole source
    categories: int | None  # how many categories the source lists them by; None = one, or not known
    about: str
    question_file: bool = False  # its prompts are the user's Spec-Bench question file (--question-file)


FAMILIES = {
    family.name: family
    for family in (
        Family("mtbench", ("workload=mtbench",), 80, 8, "MT-bench first turns, 8 categories of 10"),
        Family("mtbench_turn2", ("workload=mtbench_turn2",), 80, 8,
               "MT-bench second turns after the target's own first answer (Spec-Bench's multi-turn)"),
        Family("sharegpt", ("workload=sharegpt",), 80, None, "ShareGPT first user turns"),
        Family("sharegpt_multiturn", ("workload=sharegpt_multiturn",), 80, None,
               "ShareGPT conversations, the data's earlier turns in context"),
        Family("long_context", ("workload=long_context",), 40, 2,
               "2k-5k-token documents from Python's standard library: summarize prose, explain code"),
        Family("specbench", ("workload=specbench",), None, None, "a Spec-Bench question.jsonl (--question-file)",
               question_file=True),
        Family("synthetic", ("workload=synthetic",), 16, None, "random prompts for target=synthetic (no model)"),
    )
}

# Every shipped drafter and variant worth ranking on the shipped target (SmolLM2): the trained heads
# (bundled weights), self-speculation, the training-free drafters and the unions. Another target has
# no trained heads; name its drafters with --drafters.
DRAFTERS = (
    "union", "union_adaptive", "union_recycling", "union_retrieval", "eagle3", "eagle2", "eagle", "medusa", "mtp",
    "domino", "layerskip", "ngram", "retrieval", "recycling", "lookahead",
)
# transformers' own generation: the peers registered to be ranked (experiments/run/peers.py)
PEERS = tuple(name for name in peer_registry.PEERS.names() if peer_registry.PEERS.trait(name, "bench"))


@dataclass(frozen=True)
class BenchPlan:
    families: tuple[str, ...]
    temperatures: tuple[float, ...]
    lengths: tuple[int, ...]  # max_new_tokens
    drafters: tuple[str, ...]  # the first is each cell's drafter, the rest its rivals
    peers: tuple[str, ...]
    prompts: int | None  # workload.num_prompts for every family; None = each family's own count
    question_file: str | None  # the specbench family's question.jsonl
    overrides: tuple[str, ...]  # the user's specdec-run overrides, for every cell
    family_prompts: tuple[tuple[str, int], ...] = ()  # (family, prompts) where prompts is None: the plan's own counts


FULL = BenchPlan(
    families=("mtbench", "mtbench_turn2", "sharegpt", "sharegpt_multiturn", "long_context"),
    temperatures=(0.0, 1.0), lengths=(64, 256), drafters=DRAFTERS, peers=PEERS, prompts=None, question_file=None, overrides=(),
)
# A first look in minutes on a laptop CPU: one prompt of each MT-bench category and 8 ShareGPT
# prompts, short answers, greedy, the leading drafters of each kind and stock generate()
QUICK = BenchPlan(
    families=("mtbench", "sharegpt"), temperatures=(0.0,), lengths=(64,),
    drafters=("union", "eagle3", "ngram", "recycling"), peers=("hf_generate",), prompts=8, question_file=None,
    overrides=("repeats=1",),
)
# The grid docs/LEADERBOARD.md is generated from, sized for about 3 hours on a 2-core CPU: four
# workload families (five with --question-file), greedy and sampled, the leading drafter of each kind
# against plain decoding and transformers' own generate() and prompt lookup. Long documents cost a
# long prefill on every side, so that family has fewer prompts.
STANDARD = BenchPlan(
    families=("mtbench", "mtbench_turn2", "sharegpt_multiturn", "long_context"), temperatures=(0.0, 1.0), lengths=(64,),
    drafters=("union_adaptive", "eagle3", "recycling", "ngram"), peers=("hf_generate", "hf_prompt_lookup"),
    prompts=None, question_file=None, overrides=(),
    family_prompts=(("mtbench", 16), ("mtbench_turn2", 16), ("sharegpt_multiturn", 16), ("long_context", 6),
                    ("specbench", 16)),
)


@dataclass(frozen=True)
class Cell:
    family: str
    temperature: float
    max_new_tokens: int
    overrides: tuple[str, ...]  # the whole specdec-run command line of this cell

    @property
    def name(self) -> str:  # its run dir under the bench dir
        return f"{self.family}/T{self.temperature:g}-{self.max_new_tokens}tok"


def cells(plan: BenchPlan) -> list[Cell]:
    """Every cell of the plan, family by family, each a complete specdec-run command line. The user's
    overrides come last, so they win over the plan's. Fewer prompts than a family's source holds are
    taken evenly from its categories (workload.per_category), not all from the first category."""
    drafter, *rivals = plan.drafters
    sides = [*rivals, *plan.peers]
    found = []
    for name in plan.families:
        family = FAMILIES[name]
        prompts = plan.prompts if plan.prompts is not None else dict(plan.family_prompts).get(name, family.prompts)
        workload = [*family.overrides, *([f"workload.path={plan.question_file}"] if family.question_file else [])]
        if prompts is not None:
            workload.append(f"workload.num_prompts={prompts}")
        if prompts is not None and family.categories and (family.prompts is None or prompts < family.prompts):
            workload.append(f"workload.per_category={-(-prompts // family.categories)}")
        for temperature in plan.temperatures:
            sampling = ["sampling=greedy"] if temperature == 0 else ["sampling=sample", f"sampling.temperature={temperature:g}"]
            for length in plan.lengths:
                overrides = (
                    *workload, *sampling, f"max_new_tokens={length}", f"drafter={drafter}",
                    *([f"rivals=[{','.join(sides)}]"] if sides else []), *plan.overrides,
                )
                found.append(Cell(name, temperature, length, overrides))
    return found
