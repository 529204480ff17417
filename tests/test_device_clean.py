"""The synthetic workload, the Triton verifier's test cases and every drafter kind on a model target
keep every tensor on the data's device.

A tensor made without ``device=`` lands on the default device, the CPU; on a GPU run it then meets
CUDA tensors and raises, a bug no CPU-only run sees. So the CPU runs here play that GPU run: while
the data lives on "cpu", ``StraysOnMeta`` puts tensors made without a device on "meta" and raises
wherever one meets a CPU tensor, as CUDA does. With a CUDA device the same paths also run on it
for real.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from sequence_stats import ALPHA, sequence_verdict
from test_triton_verifier import DEVICE, LOOP_CASES, ULP_BLOCK_V, X1, X2, CheckedTriton, assert_same, one_ulp_case
from tiny_models import tiny_model
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from drafters.synthetic import SyntheticDrafter
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.synthetic import SyntheticTarget
from specdec.target import HFTarget
from specdec.tree import SiblingMode
from verifiers import reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# the usual factories among those torch.set_default_device redirects (torch.utils._device)
CONSTRUCTORS = {
    torch.arange, torch.as_tensor, torch.asarray, torch.empty, torch.eye, torch.full, torch.linspace,
    torch.ones, torch.rand, torch.randint, torch.randn, torch.randperm, torch.scalar_tensor, torch.tensor,
    torch.zeros,
}


class StraysOnMeta(TorchFunctionMode):
    """torch.set_default_device("meta"), plus a device check on every torch call: some CPU kernels
    (scatter_, indexing) read a meta argument's missing data without complaint, where CUDA would
    raise. as_tensor / asarray of a tensor keep its device, as on a GPU run (decode.check_prompts
    converts each prompt so)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        converts = func in (torch.as_tensor, torch.asarray) and isinstance(args[0], torch.Tensor)
        if func in CONSTRUCTORS and kwargs.get("device") is None and not converts:
            kwargs["device"] = "meta"
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if len({t.is_meta for t in tensors}) > 1:
            raise RuntimeError(f"{getattr(func, '__name__', func)}: a tensor made without device= meets the data")
        return func(*args, **kwargs)


def guarded(device: str):
    # on an accelerator the default device, the CPU, is already somewhere else
    return StraysOnMeta() if device == "cpu" else contextlib.nullcontext()


@pytest.mark.parametrize(
    "mix",
    [
        lambda data: data + torch.arange(4),
        lambda data: data.clone().scatter_(0, data, torch.arange(4)),  # the CPU kernel alone accepts this
        lambda data: data[torch.arange(4)],
    ],
    ids=["add", "scatter_", "index"],
)
def test_the_guard_catches_a_tensor_made_without_a_device(mix):
    data = torch.arange(4, device="cpu")  # [4]
    with StraysOnMeta(), pytest.raises(RuntimeError, match="without device="):
        mix(data)
    assert mix(data).device.type == "cpu", "the guard must not outlive its block"


# the fast tier keeps the sampled chain through the interpreted kernel; the other trees run with integration
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [c if c == "chain3-iid-T1" else pytest.param(c, marks=pytest.mark.integration)
                                  for c in LOOP_CASES])
def test_sequence_distribution_and_decode_loop(device, case):
    """sequence_distribution, the whole loop through the verifier (the Triton kernel, checked against
    the reference, where the kernel runs on this device), and sequence_verdict's statistics."""
    branching, mode, sampling = LOOP_CASES[case]
    vocab, length = 4, 2
    verifier = CheckedTriton() if device == DEVICE else reference.verify
    with guarded(device):
        target = SyntheticTarget(vocab_size=vocab, sharpness=1.5, device=device)
        exact = target.sequence_distribution([1, 2], length, sampling)  # [V ** L]
        decoder = SpecDecoder(target, SyntheticDrafter(target, branching, mode, 0.5), verifier)
        # not a list: check_prompts turns a list into a tensor without a device and moves it later,
        # right on a GPU, but on meta that tensor has no values to move
        prompt = torch.tensor([1, 2], device=device)  # [P]
        verdict = sequence_verdict(decoder, exact, prompt, length, vocab, sampling, samples=32, seed=1)
    assert exact.device.type == device and abs(exact.sum().item() - 1) < 1e-6  # float32 probabilities
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.integration  # on the CPU the fast tier runs the kernel's case in test_triton_verifier
@pytest.mark.parametrize("mode", SiblingMode, ids=lambda m: m.name)
def test_one_ulp_case(device, mode):
    with guarded(device):
        tree, target_logits, noise, sampling, _ = one_ulp_case(mode, [X1, X2], device)
        if device == DEVICE:
            result = assert_same(tree, target_logits, sampling, noise, ULP_BLOCK_V)
        else:
            result = reference.verify(tree, target_logits, sampling, noise)
    assert target_logits.device.type == device and noise.final.device.type == device
    assert result.accepted_nodes[:, 0].tolist() == [-1, 1]


def model_drafters(target, folder) -> dict:
    """name -> (drafter config for the registry, verifier): every drafter kind on a model target,
    with heads and data saved under ``folder`` as a run reads them (loaded, then moved to the
    target's device), and the chain and static-tree verifiers on the drafters they serve."""
    from drafters.domino import DominoConfig, DominoHead
    from drafters.formats.load import save_domino
    from drafters.eagle import EagleConfig, EagleHead
    from drafters.heads import save_head
    from drafters.medusa import MedusaConfig, MedusaHeads, save_heads, with_tree
    from drafters.mtp import MTPConfig, MTPHead
    from drafters.retrieval import Datastore

    torch.manual_seed(0)
    save_head(EagleHead(EagleConfig.for_target(target)), folder / "eagle")
    save_head(EagleHead(EagleConfig.for_target(target, feature_layers=(1, 2))), folder / "eagle3")
    save_head(MTPHead(MTPConfig.for_target(target, 1, 2)), folder / "mtp", kind="mtp")
    save_domino(DominoHead(DominoConfig.for_target(target, block_size=2)), folder / "domino")
    save_heads(with_tree(MedusaHeads(MedusaConfig.for_target(target, 2)), [[0.6, 0.2], [0.4, 0.2]], [(0,), (1,), (0, 0)]),
               folder / "medusa")
    tiny_model("llama", seed=1, layers=1, sharpness=4.0).save_pretrained(folder / "draft")
    Datastore.build([[5, 6, 7, 8, 5, 6, 7, 8, 9], [3, 4, 3, 4, 3], [9, 10, 11, 9, 10, 11]], target.vocab_size).save(folder / "store")
    eagle3 = {"name": "eagle3", "checkpoint": str(folder / "eagle3"), "depth": 3, "top_k": 2, "total_tokens": 5}
    return {
        "eagle-chain-block": ({"name": "eagle", "checkpoint": str(folder / "eagle"), "depth": 3}, "block"),
        "eagle2": ({"name": "eagle2", "checkpoint": str(folder / "eagle"), "depth": 3, "top_k": 2, "total_tokens": 5}, "reference"),
        "eagle3-wor": ({**eagle3, "sampling": "sampled_wor"}, "reference"),
        "eagle3-static-traversal": ({**eagle3, "sampling": "sampled_iid", "shape": "static", "total_tokens": 6}, "traversal"),
        "medusa": ({"name": "medusa", "checkpoint": str(folder / "medusa")}, "reference"),
        "mtp": ({"name": "mtp", "checkpoint": str(folder / "mtp")}, "reference"),
        "domino": ({"name": "domino", "checkpoint": str(folder / "domino")}, "reference"),
        "draft_model": ({"name": "draft_model", "model_path": str(folder / "draft"), "num_draft": 3}, "reference"),
        "layerskip": ({"name": "layerskip", "skip": [1], "num_draft": 3}, "reference"),
        "ngram": ({"name": "ngram", "num_draft": 4, "max_branches": 3}, "reference"),
        "retrieval": ({"name": "retrieval", "datastore": str(folder / "store"), "min_count": 1, "min_fraction": 0.0}, "reference"),
        "recycling": ({"name": "recycling"}, "reference"),
        "lookahead": ({"name": "lookahead", "window": 3, "ngram": 3, "guesses": 2}, "reference"),
        "union_adaptive": ({"name": "union", "members": [{**eagle3, "depth": 2, "total_tokens": 3}, {"name": "ngram"}],
                            "costs": [1.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5], "max_rows": 6, "adaptive": True, "calibration": []},
                           "reference"),
    }


MODEL_DRAFTERS = ["eagle-chain-block", "eagle2", "eagle3-wor", "eagle3-static-traversal", "medusa", "mtp", "domino",
                  "draft_model", "layerskip", "ngram", "retrieval", "recycling", "lookahead", "union_adaptive"]


@pytest.fixture(scope="module", params=DEVICES)
def model_target(request, tmp_path_factory):
    """(a tiny llama target on the device, its drafter configs)."""
    target = HFTarget(tiny_model("llama", sharpness=4.0).to(request.param))
    return target, model_drafters(target, tmp_path_factory.mktemp(f"drafters-{request.param}"))


# on a CPU, where the rest of the suite already runs every drafter, the fast tier keeps T = 0 and
# integration takes T = 1; on a GPU (scripts/gpu_check.sh runs every test of this file) both
@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.integration)])
@pytest.mark.parametrize("name", MODEL_DRAFTERS)
def test_every_drafter_on_a_model_target(model_target, name, temperature):
    """Each drafter kind through the whole loop on an HF target whose data lives on the device
    (a continuous batch: admissions, finished requests leaving). Drafters are built outside the
    guard, as a run loads weights on the CPU and moves them; everything they make while decoding
    runs under it. On the CPU greedy output must also equal plain decoding's."""
    from drafters import base
    from verifiers.select import select_verifier

    target, configs = model_target
    options, verifier = configs[name]
    options = dict(options)
    drafter = base.build(options.pop("name"), target, **options)
    device = target.device.type
    prompts = [torch.tensor(p, device=target.device) for p in ([5, 6, 7, 8, 5, 6, 7], [3], [9, 10, 11, 9, 10])]
    sampling = SamplingParams(temperature)
    with guarded(device):
        out = SpecDecoder(target, drafter, select_verifier(verifier)).generate(prompts, 10, sampling, seed=1, max_batch=2)
    assert [len(o) for o in out.outputs] == [10, 10, 10]
    if device == "cpu" and temperature == 0:
        plain = SpecDecoder(target, None, reference.verify).generate(prompts, 10, sampling, seed=1)
        assert out.outputs == plain.outputs


@pytest.mark.parametrize("device", DEVICES)
def test_specdec_run_computes_on_the_target_device(device, tmp_path):
    """target.device through specdec-run, on a model and on the synthetic target: the target, the
    drafter and the verifier (the synthetic run's auto: the kernel on CUDA, the reference on the
    CPU) on that device, and results.json naming it. A GPU machine without Hydra (the device image has none) skips it
    unless scripts/gpu_check.sh is given its wheels (the script's header says how)."""
    pytest.importorskip("hydra")
    from test_run_cli import run_in_process

    from specdec.target_loader import TargetConfig, open_target

    tiny_model("llama", sharpness=4.0).save_pretrained(tmp_path / "tiny")
    common = [f"target.device={device}", "workload.num_prompts=3", "max_new_tokens=8", "logger=none", "repeats=1"]
    for name, overrides in [("synthetic", ["experiment=synthetic"]),
                            # the reference: on a GPU each vocabulary compiles its own kernel variants
                            ("model", ["target=hf", f"target.path={tmp_path / 'tiny'}", "workload=synthetic",
                                       "workload.prompt_length=20", "drafter=ngram", "verifier=reference"])]:
        results = run_in_process(tmp_path / name, [*overrides, *common])
        # a float32 model is under the logits contract: on a GPU greedy equality is measured, not promised
        assert results["exactness_contract"] == ("bitwise" if name == "synthetic" else "logits"), name
        assert results["num_prompts"] == 3 and (results["greedy_equal"] is True or device != "cpu" and name == "model"), name
        assert (results["provenance"]["machine"]["gpu"] is None) == (device == "cpu"), name
    assert open_target(TargetConfig(path=str(tmp_path / "tiny"), name="hf", device=device), False).load().device.type == device
