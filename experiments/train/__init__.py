"""specdec-train: train a drafter head for any Hugging Face target, resumably.

    specdec-train                                   # EAGLE-1 head for SmolLM2 on ShareGPT features
    specdec-train train=eagle3 loop.steps=2000      # EAGLE-3: fused layers, training-time test
    specdec-train target=hf target.path=/path/to/hf/model data.conversations=5000
    specdec-train train=eagle3 data.regenerate=true init=drafters/checkpoints/eagle3-smollm2  # fine-tune on the target's own answers
    torchrun --nproc_per_node=2 -m experiments.train loop.steps=1000  # data parallel (gloo on CPU)

    specdec-train train=eagle3 features=online target.device=cuda  # no cache: the target computes each batch's features
    specdec-train loop.steps=0                      # extract the features only
    specdec-train schedule=gpu target.device=cuda   # EAGLE-3, MTP and Domino in turn within 480 s (configs/schedule/gpu.yaml)
    specdec-train train=eagle3 loop.steps=2000 resume=latest  # continue the last killed eagle3 run

The target is chosen as for specdec-run (configs/target/, specdec.target_loader): target=smollm2 or
target=hf target.path=DIR, a model whose tokenizer has a chat template. Every default lives in the
schema: the training loop's (loop.*) in drafters.training.trainer.TrainConfig, the rest in
experiments/train/schema.py TrainRunConfig; configs/train.yaml only picks the config groups.

One recipe (recipe.py: setup, train, cleanup) trains every head, with a choice of feature source:
features=cached (the default) extracts the target's features once into a shared cache and trains on
the CPU, in float32, under torchrun too; features=online has the target compute each batch's features
as training runs (online.batch_tokens per batch), on target.device (cuda: bf16 autocast), for the
methods registered with online=True (drafters.training.methods: eagle, eagle3, mtp, dflash, domino).

Stages, each resumable: (1) with features=cached, target features are extracted once into a shared on-disk cache
(data.features_dir, keyed by target; shards are written atomically; loop.steps=0 stops here), (2)
the head trains with AdamW, warmup + cosine and gradient clipping, checkpointing into the run dir
every loop.checkpoint_every steps (init=DIR starts from an exported head instead of a new one), (3)
the final head is exported (output=DIR, safetensors + config.json) and (4) evaluated: tau and greedy
equality on held-out MT-bench prompts against plain decoding; with loop.snapshot_every=N and
eval.curve=true also tau of every N-step snapshot against the training tokens it had seen
(train_results.json "curve" and tau_vs_tokens.png). Methods (EAGLE, EAGLE-3, Medusa, ...) live in
drafters/training/ behind drafters.training.methods.

The run dir is locked while a training writes there: a second training into it is refused in one line.
Resuming after a kill: a run dir with a checkpoint continues from it (it says "resuming from step N
of <dir>"), ending bitwise equal to an unbroken run. resume=PATH continues the run in the dir PATH;
resume=latest continues the newest unfinished run beside this command's own run dir (by default
outputs/train/<train.name>/): one that holds a complete checkpoint and no train_results.json, the
newest being the one that wrote a checkpoint last. Either way the command must repeat the settings
that shape the head and its data (train.*, target.*, features, data.*, online.* with features=online, init, batch_size, loop.lr,
loop.warmup_steps, loop.weight_decay, loop.grad_clip, loop.seed; loop.steps may grow), checked
against the run's .hydra/config.yaml, which stays the record of how the run started; the new run
dir Hydra made for this command is removed. Rerunning with hydra.run.dir=<that dir> also resumes,
but overwrites that record.

The package:
    schema.py   the Hydra schema and every check that needs nothing loaded
    sources.py  the training text (ShareGPT, or the target's own answers) and the feature cache
    recipe.py   TrainRecipe (setup / train / cleanup) and the two feature sources, without Hydra
    command.py  the entry point: run dir (locked, or resumed), the recipe, the evaluation, train_results.json
    schedule.py schedule=NAME: several methods through the recipe on shares of one time budget
"""


def main() -> None:
    """specdec-train. Imported on the call, so that importing the package (its recipe, used without
    Hydra) loads none of the command's Hydra."""
    from experiments.train.command import main as command  # Hydra, transformers: the recipe needs neither

    command()
