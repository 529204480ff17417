"""specdec-run: plain and speculative decoding on the same prompts, measured against each other in one run.

    specdec-run                                    # SmolLM2, MT-bench prompts, the union drafter, T=0
    specdec-run experiment=synthetic               # the whole pipeline in seconds, no model
    specdec-run drafter=none workload=jsonl workload.path=prompts.jsonl workload.field=text
    specdec-run -m sampling.temperature=0,1        # a sweep: one run dir per point

Every side (the baseline, the drafter, each rival drafter and transformers peer) decodes the same
prompts, unit by unit (group_size prompts, batch_size in flight, continuous batching within a
unit), after an untimed warm-up pass and for `repeats` timed passes, the sides taking turns
(experiments/run/measure.py). Speedup = (speculative tokens / speculative wall time) / (baseline
tokens / baseline wall time) over every unit and pass; it and tau come with a 95% paired bootstrap
interval over units (specdec.intervals). `rivals=[...]` adds drafters (a drafter config's name,
or `{drafter: NAME, option: value}`) and transformers' own generation (`hf_generate`,
`hf_prompt_lookup`, `hf_assisted`, `hf_early_exit`, or `{peer: NAME, option: value}`), each also
compared with the run's drafter on the same units. `budget.mode=auto` first chooses the drafter's
depth / tree size from the target's measured T(n) and the drafter's measured acceptance
(specdec.speedup.choose_tree_budget).

Writes into the Hydra run dir: steps.jsonl (one row per speculative decode step), prompts.jsonl
(one row per prompt), units.jsonl (each unit's tokens and seconds per side and pass: what the
intervals come from), per_depth_alpha.png, tau_per_prompt.png and, last, results.json (with its
provenance: machine, date, commit, command). Each file
is written under a temporary name and renamed, so an interrupted run leaves complete files or none.

The package, in the order a run goes through it:
    schema.py     the Hydra schema and every check that needs nothing loaded
    workloads.py  where prompts come from (WORKLOADS: a new workload registers here)
    rivals.py     the `rivals` setting: drafters and transformers peers measured beside the drafter
    peers.py      transformers' own generation as sides
    build.py      the target, requests and verifier (Pieces), and one side per way of decoding
    budget.py     budget.mode=auto: depth and tree size from T(n) and acceptance
    measure.py    sides on the same units: warmed, interleaved, repeated
    summary.py    results.json's numbers with intervals, the rows and the console tables
    provenance.py the machine, date, commit and command each results.json records
    command.py    run() and the entry point
The run dir's files (outputs.py), the sinks, the plots and the units.jsonl records are shared with
specdec-analyze and specdec-bench in experiments/common/.
"""

from experiments.run.command import main, run

__all__ = ["main", "run"]
