"""The research questions of docs/RESULTS.md "Studies", each a list of specdec-runs on SmolLM2 (one on Gemma 3) with
>= 40 prompts spread over categories, 64-token answers and one timed pass, every drafter of a run
paired with the same plain decoding (rivals) so that each figure has an interval:

    specdec-bench studies --out outputs/studies threads=2           # all seven, resumable
    specdec-bench studies --only temperature,context --out outputs/studies

Each run's dir is <out>/<run name>; when every run of a study is done, specdec-analyze writes its
report and plots to <out>/reports/<study>. The synthetic half of study (a), the model against the
loop with exactly known costs, is the Hydra preset configs/experiment/study_analytic.yaml.

A new study is one more entry in studies(): its runs are specdec-run command lines, checked like a
bench's cells before the first one runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# MT-bench first turns, 5 from each of its 8 categories
MTBENCH_40 = ("workload.per_category=5", "workload.num_prompts=40")
EVERY_RUN = ("max_new_tokens=64", "repeats=1")


@dataclass(frozen=True)
class StudyRun:
    name: str  # its run dir under the studies dir
    overrides: tuple[str, ...]  # the whole specdec-run command line


@dataclass(frozen=True)
class Study:
    name: str  # its report dir under <out>/reports, and docs/data/studies/<name>
    question: str
    runs: tuple[StudyRun, ...]


def studies(out: Path, user: tuple[str, ...] = ()) -> dict[str, Study]:
    """Every study, in the order they run (the forecast reads the greedy temperature run's
    acceptance, so it comes after it); ``user``: overrides for every run, last so they win."""

    def runs(*specs: tuple[str, tuple[str, ...]]) -> tuple[StudyRun, ...]:
        return tuple(StudyRun(name, (*overrides, *EVERY_RUN, *user)) for name, overrides in specs)

    temperatures = [("0", ("sampling=greedy",))] + [
        (t, ("sampling=sample", f"sampling.temperature={t}")) for t in ("0.5", "1.0", "1.5")
    ]
    contexts = ((1000, 2000), (4000, 6000), (9000, 11000))  # characters: ~0.3k, ~1.2k, ~2.5k SmolLM2 tokens

    def tree_rivals(drafter: str, sizes: tuple[int, ...], shape: str = "") -> str:
        return "rivals=[" + ",".join(f"{{drafter: {drafter}{shape}, total_tokens: {n}}}" for n in sizes) + "]"

    # Gemma 3 has no EAGLE-1 head: its EAGLE-3 head grows the same depth-4, top-4 dynamic tree
    gemma_tree = ", depth: 4, top_k: 4"
    found = (
        Study("temperature", "(b) acceptance and speedup from T = 0 to 1.5", runs(
            *((f"b_T{t}", (*MTBENCH_40, *sampling, "drafter=eagle3", "rivals=[union_adaptive]"))
              for t, sampling in temperatures))),
        Study("forecast", "(a) the analytic model as a forecast: ShareGPT predicted from MT-bench acceptance", runs(
            ("a_sharegpt_forecast", ("workload=sharegpt", "workload.num_prompts=40", "drafter=eagle3",
                                     "budget.mode=auto", f"budget.acceptance={out / 'b_T0' / 'results.json'}")))),
        Study("drafter-cost", "(d) what a drafter costs against what it buys, an independent draft model included", runs(
            ("d_cost", (*MTBENCH_40, "drafter=draft_model", "drafter.model_path=smollm2",
                        "rivals=[ngram,eagle,eagle3,medusa,mtp,domino,layerskip]")))),
        Study("context", "(c) context length, with the prefill share", runs(
            *((f"c_ctx_{low}", ("workload=long_context", "workload.num_prompts=40", f"workload.min_chars={low}",
                                f"workload.max_chars={high}", "drafter=ngram", "warmup_tokens=0"))
              for low, high in contexts))),
        Study("tree-budget", "(f) tree size against measured T(n), in float32 and bfloat16", runs(
            *((f"f_tree_{target}", (*MTBENCH_40, f"target={target}", "drafter=eagle2", "drafter.total_tokens=1",
                                    tree_rivals("eagle2", (4, 8, 16, 32))))
              for target in ("smollm2", "smollm2_bf16")))),
        Study("tree-budget-gemma3", "(f) on Gemma 3 270M: tree size against measured T(n), float32", runs(
            ("f_tree_gemma3_270m", (*MTBENCH_40, "target=gemma3_270m", "drafter=eagle3", "drafter.depth=4",
                                    "drafter.top_k=4", "drafter.total_tokens=1",
                                    tree_rivals("eagle3", (4, 8, 16), gemma_tree))))),
        Study("quantized", "(e) quantized EAGLE-3 heads: acceptance (weights rounded) and the cost of real int8 kernels",
              runs(*((f"e_quant_{scheme}", (*MTBENCH_40, f"drafter_quant={scheme}", "drafter=eagle3"))
                     for scheme in ("int8", "int4", "int8_kernels")))),
    )
    return {study.name: study for study in found}
