"""Training heads on a lent GPU machine: what is staged here and what runs there (scripts/gpu_train.sh).

    stage.py     here: the target and the tokenised conversations packed into parts that device calls
                 carry (``python -m experiments.train.device.stage slim|stage|plan|unslim``); there:
                 ``check`` verifies the parts and rebuilds the target
    weights.py   the target's weights in their exact block-quantised form (a fifth of fp32), for stage.py
    slim.py      the bundled checkpoints left out of what the calls carry (stage.py's slim/unslim)
    schedule.py  there: several methods, each through the training recipe (experiments.train.recipe) with
                 features=online, on shares of one time budget

Nothing here imports Hydra: the device image has none.
"""
