"""The GPU training chain on a CPU with a tiny target: staging in parts (scripts/device/stage.py),
reassembly, exact weights, online features, specdec-train schedule=gpu on a time budget, and
checkpoints the drafters load and draft with."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import greedy_outputs, save_chat_model, tiny_model

from test_train_cli import invoke

from drafters.training.online import OnlineData, TokenSequences, target_features
from experiments.train.sources import read_sequences, write_sequences
from scripts.device import slim, stage
from specdec.assets import Conversation
from specdec.target import HFTarget

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
WORDS = "the cat sat on a mat and then it ran far away to see the dog who was big".split()


def conversations(count: int) -> list[Conversation]:
    """Seeded chats of a user turn and an answer, some with a second exchange."""
    generator = torch.Generator().manual_seed(0)
    say = lambda n: " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n,), generator=generator))
    chats = []
    for index in range(count):
        turns = (("user", say(4)), ("assistant", say(12)))
        chats.append(Conversation(str(index), turns + ((("user", say(3)), ("assistant", say(8))) if index % 3 else ())))
    return chats


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    """The tiny character-level GPT-2 with a chat template (a fast tokenizer: staging reads offsets)."""
    return save_chat_model(tmp_path_factory.mktemp("tiny-chat"), TEMPLATE)


def quantised(rows: int, columns: int, kind: str, seed: int) -> torch.Tensor:  # [rows, columns] float32
    """Weights as a GGUF dequantisation leaves them: per 32-weight block, d * q + m (Q4_1) or q * d (Q8_0)."""
    blocks = torch.randn(rows * columns // 32, 32, generator=torch.Generator().manual_seed(seed))
    if kind == "q4_1":
        low = blocks.min(1).values.half()
        d = ((blocks.max(1).values - low.float()) / 15).half()
        q = torch.round((blocks - low.float()[:, None]) / d.float()[:, None]).clamp(0, 15)
        return (q * d.float()[:, None] + low.float()[:, None]).reshape(rows, columns)
    d = (blocks.abs().max(1).values / 127).half()
    q = torch.round(blocks / d.float()[:, None]).clamp(-127, 127).to(torch.int8).float()  # integer codes: no -0.0
    return (q * d.float()[:, None]).reshape(rows, columns)


def test_weights_travel_as_their_quantisation_blocks_and_decode_bit_for_bit():
    state = {"q4": quantised(8, 64, "q4_1", 0), "q8": quantised(4, 96, "q8_0", 1), "norm": torch.rand(64),
             "dense": torch.randn(8, 64), "odd": torch.randn(3, 40)}
    nudged = state["q4"].clone()
    nudged[2, 5] = torch.nextafter(nudged[2, 5], torch.tensor(9.0))  # one weight off its block's grid
    state["nudged"] = nudged
    encoded = stage.encode_weights(state)
    kinds = {key.split("/")[1]: key.split("/")[0] for key in encoded}
    assert kinds == {"q4": "q4_1", "q8": "q8_0", "norm": "raw", "dense": "raw", "odd": "raw", "nudged": "raw"}
    size = lambda prefix: sum(t.numel() * t.element_size() for k, t in encoded.items() if k.startswith(prefix))
    assert size("q4_1/q4/") * 6 < state["q4"].numel() * 4 and size("q8_0/q8/") * 3.5 < state["q8"].numel() * 4
    decoded = stage.decode_weights(encoded)
    assert decoded.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(decoded[name].view(torch.int32), tensor.view(torch.int32)), name
    assert stage.weights_digest(decoded) == stage.weights_digest(state)
    decoded["dense"] = decoded["dense"].clone().index_fill_(1, torch.tensor([0]), 2.0)
    assert stage.weights_digest(decoded) != stage.weights_digest(state)


def test_q5_0_blocks_travel_as_small_codes_even_where_a_negative_scale_made_minus_zeros():
    """Q5_0 decodes (q - 16) * d with d of either sign, so a code of 16 under a negative d is -0.0."""
    generator = torch.Generator().manual_seed(3)
    d = (torch.rand(16, 1, generator=generator) * 0.01 + 0.001).half().float() * torch.tensor([1.0, -1.0]).repeat(8)[:, None]
    q = torch.randint(0, 32, (16, 32), generator=generator).float() - 16
    q[:, 0] = -16.0  # the block's largest magnitude sits at code 0, as the quantiser puts it
    state = {"q5": (q * d).reshape(8, 64)}
    assert (state["q5"].view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any()
    encoded = stage.encode_weights(state)
    assert set(encoded) == {"q8_0/q5/codes", "q8_0/q5/scale"} and int(encoded["q8_0/q5/codes"].abs().max()) <= 16
    assert torch.equal(stage.decode_weights(encoded)["q5"].view(torch.int32), state["q5"].view(torch.int32))


def test_k_quant_tensors_travel_as_the_gguf_blocks_they_came_from(tmp_path):
    """Q4_K (q * d*sc - dmin*m per 32) and Q6_K (q * d*sc per 16): the scales are read from the GGUF,
    matched to the model's tensors by content, and the codes rebuild every weight bit for bit."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from scripts.device.weights import gguf_kquant_scales

    rng = np.random.default_rng(0)
    raws = {}
    for name, kind, size, scale_at in [("a", GGMLQuantizationType.Q4_K, 144, (0, 2)), ("b", GGMLQuantizationType.Q6_K, 210, (208,))]:
        blocks = rng.integers(0, 256, (4 * 2, size), dtype=np.uint8)  # 4 rows of 512 weights: 2 blocks of 256 a row
        for at in scale_at:  # finite float16 super-block scales
            blocks[:, at:at + 2] = (rng.random(len(blocks)) * 0.01 + 0.001).astype(np.float16).view(np.uint8).reshape(-1, 2)
        raws[name] = (kind, blocks.reshape(4, 2 * size))
    writer = GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for name, (kind, raw) in raws.items():
        writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    state = {name: torch.from_numpy(quants.dequantize(raw, kind).copy()) for name, (kind, raw) in raws.items()}
    state["nudged"] = state["a"].clone()
    state["nudged"][1, 3] = torch.nextafter(state["nudged"][1, 3], torch.tensor(9.0))  # no GGUF tensor holds it
    encoded = stage.encode_weights(state, gguf_kquant_scales(tmp_path / "m.gguf"))
    kinds = {key.split("/")[1]: key.split("/")[0] for key in encoded}
    assert kinds == {"a": "q4_k", "b": "q6_k", "nudged": "raw"}
    assert encoded["q4_k/a/scale"].shape == (4, 16) and encoded["q6_k/b/scale"].shape == (4, 32)
    decoded = stage.decode_weights(encoded)
    for name, tensor in state.items():
        assert torch.equal(decoded[name].view(torch.int32), tensor.view(torch.int32)), name


def test_a_sequences_file_holds_the_sequences_and_prompts_it_was_given(tmp_path):
    """data.sequences: what stage writes is what specdec-train reads, in 16 bits where the vocabulary allows."""
    sequences, prompts = [[1, 2, 3], [65535, 0], [7] * 9], [[4, 5], [6]]
    for vocab_size, width in [(1 << 16, 2), (1 << 17, 4)]:
        write_sequences(tmp_path / "s.npz", sequences, prompts, vocab_size)
        assert read_sequences(tmp_path / "s.npz", "tokens") == sequences and read_sequences(tmp_path / "s.npz", "prompts") == prompts
        import numpy as np

        assert np.load(tmp_path / "s.npz")["tokens"].itemsize == width


def test_online_batches_hold_the_features_and_labels_a_cache_would():
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    lengths, layers = [5, 9, 3], (1, 2)
    tokens = torch.randint(128, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    trained = torch.rand(sum(lengths), generator=torch.Generator().manual_seed(1)) < 0.5
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    sequences = TokenSequences(tokens, offsets, trained)
    batch = OnlineData(target, sequences, layers, batch_tokens=1000).batch(torch.arange(3))
    assert batch.tokens.shape == (3, 9) and batch.features.shape == (3, 9, 128)
    for row, length in enumerate(lengths):
        start = int(offsets[row])
        sequence = tokens[start : start + length]
        # what extract_features stores: HFTarget.prefill with a trailing dummy token
        hidden = target.prefill([torch.cat([sequence, torch.zeros(1, dtype=torch.int64)])], layers + (3,)).hidden
        torch.testing.assert_close(batch.features[row, :length], torch.cat(hidden[:2], -1)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batch.final[row, :length], hidden[2][0], atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            choices = target.model(sequence[None]).logits[0].argmax(-1)
        next_trained = torch.cat([trained[start + 1 : start + length], torch.zeros(1, dtype=torch.bool)])
        expected = torch.where(next_trained, choices, torch.full_like(choices, -1))
        assert torch.equal(batch.labels[row, :length], expected) and bool((batch.labels[row, length:] == -1).all())
    assert torch.equal(batch.valid, batch.labels >= 0)
    with pytest.raises(ValueError, match="out of range"):
        target_features(target, batch.tokens, (9,))


def test_online_batches_cover_every_sequence_once_an_epoch_in_a_seeded_order():
    target = HFTarget(tiny_model("llama"))
    lengths = torch.tensor([3, 40, 7, 7, 12, 5, 30, 2])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    tokens = torch.randint(128, (int(lengths.sum()),))
    data = OnlineData(target, TokenSequences(tokens, offsets, torch.ones_like(tokens, dtype=torch.bool)), (1,),
                      batch_tokens=40, seed=3)
    assert sorted(torch.cat(data.groups).tolist()) == list(range(8))
    assert all(len(g) * int(lengths[g].max()) <= 40 for g in data.groups)
    epoch = [b.tokens for b, _ in zip(data.batches(0), range(len(data.groups)))]
    again = [b.tokens for b, _ in zip(data.batches(2), range(len(data.groups) - 2))]
    assert all(torch.equal(x, y) for x, y in zip(epoch[2:], again))
    assert sum(int((t != 0).sum()) for t in epoch) == int((tokens != 0).sum())


def test_training_losses_make_no_tensor_off_the_data_device():
    """Every method's loss on an online batch, with tensors made without device= caught (they would
    meet CUDA tensors on the GPU machine)."""
    from test_device_clean import StraysOnMeta

    from drafters.training.methods import build_method
    from drafters.training.online import choice_vocabulary, online_head_data

    target = HFTarget(tiny_model("llama", sharpness=4.0))
    tokens = torch.randint(128, (60,), generator=torch.Generator().manual_seed(0))
    sequences = TokenSequences(tokens, torch.tensor([0, 25, 60]), torch.ones(60, dtype=torch.bool))
    for options in [{"name": "eagle3", "feature_layers": [1, 2, 3], "unroll": 2, "regression_weight": 0.0},
                    {"name": "mtp", "depth": 2}, {"name": "domino", "feature_layers": [1, 3], "block_size": 3}]:
        method = build_method({**options, "draft_vocab": 32})
        data = OnlineData(target, sequences, method.feature_layers(target), batch_tokens=100)
        prepared = method.prepare_on(target, online_head_data(data, choice_vocabulary(data, 32, 10)))
        batch = next(prepared.batches(0))
        with StraysOnMeta():
            loss, _ = prepared.loss(batch)
        loss.backward()
        assert torch.isfinite(loss), options["name"]


def test_the_recipe_refuses_online_features_to_a_method_registered_without_them(tmp_path):
    from drafters.training.methods import build_method
    from experiments.train.recipe import OnlineFeatures, TrainRecipe

    target = HFTarget(tiny_model("llama", sharpness=4.0))
    tokens = torch.randint(128, (60,), generator=torch.Generator().manual_seed(0))
    sequences = TokenSequences(tokens, torch.tensor([0, 25, 60]), torch.ones(60, dtype=torch.bool))
    features = OnlineFeatures(OnlineData(target, sequences, (target.num_layers + 1,), batch_tokens=100), torch.arange(32))
    with pytest.raises(ValueError, match="train=medusa trains on cached features only"):
        TrainRecipe(build_method({"name": "medusa"}), target, tmp_path).setup(features)
    prepared = TrainRecipe(build_method({"name": "mtp", "draft_vocab": 32}), target, tmp_path).setup(features)
    assert prepared.num_tokens == 60 and len(prepared.model.draft_ids) == 32  # the control: mtp declared online=True


def stage_tiny(model_dir: Path, out: Path) -> dict:
    return stage.stage(model_dir, "tiny", conversations(30), out, part_bytes=64 * 1024, max_length=64)


# specdec-train schedule=gpu sized down to the 2-layer target and a CPU
TINY_SETTINGS = ["target.device=cpu", "eval.prompts=0", "schedule.budget_s=60", "schedule.max_steps=2",
                 "online.batch_tokens=256", "schedule.reserve_s=0", "online.label_tokens=500", "schedule.generate_s=30",
                 "data.regenerate_batch=3", "data.regenerate_tokens=6", "data.max_length=64"]
# SmolLM2's layers in configs/train/*.yaml, and Domino's block, sized down to the 2-layer target
EAGLE3_LAYERS = ["+schedule.train.eagle3.feature_layers=[1,2,3]"]
DOMINO_SIZES = ["+schedule.train.domino.feature_layers=[1,3]", "+schedule.train.domino.block_size=4",
                "+schedule.train.domino.num_anchors=16"]


def check_checkpoints_draft(out: Path, model_dir: Path, methods: list[str]) -> None:
    """Each exported head loads with its drafter's own loader and drafts exactly (greedy = plain)."""
    from transformers import AutoModelForCausalLM

    from drafters.domino import DominoDrafter
    from drafters.eagle import EagleDrafter, load_head
    from drafters.formats.load import load_domino
    from drafters.mtp import MTPDrafter, load_mtp
    from specdec.decode import SpecDecoder
    from specdec.sampling import SamplingParams
    from verifiers import reference

    target = HFTarget(AutoModelForCausalLM.from_pretrained(model_dir))
    prompts = [[40, 41, 42, 43], [50, 60, 70]]
    plain = greedy_outputs(target, prompts, 10)
    build = {"eagle3": lambda: EagleDrafter(target, load_head(out / "eagle3", target), depth=2),
             "mtp": lambda: MTPDrafter(target, load_mtp(out / "mtp", target)),
             "domino": lambda: DominoDrafter(target, load_domino(out / "domino", target))}
    for name in methods:
        generated = SpecDecoder(target, build[name](), reference.verify).generate(prompts, 10, SamplingParams(0.0))
        assert generated.outputs == plain, name


def check_results(out: Path, methods: list[str]) -> dict:
    """What the device tool returns (at most 8 files, each under 16 MiB, at most 2 folders down), and
    the results: every method trained its steps and exported its head."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 3 and p.stat().st_size < 16 << 20 for p in files)
    results = json.loads((out / "results.json").read_text())
    assert not results["failed"] and list(results["methods"]) == methods
    for name, record in results["methods"].items():
        assert record["steps"] == 2 and record["labels_seen"] > 0, name
        assert (out / name / "config.json").is_file() and (out / name / "model.safetensors").is_file(), name
    return results


def test_staged_parts_reassemble_into_the_same_model_and_train_a_head_that_drafts(tmp_path, chat_model_dir, capsys):
    manifest = stage_tiny(chat_model_dir, tmp_path / "stage")
    parts = manifest["parts"]
    assert len(parts) >= 3 and max(p["bytes"] for p in parts) <= 64 * 1024
    assert manifest["data"]["sequences"] == 30 and manifest["data"]["prompts"] == 30
    # the device side: parts arrive one call at a time; check says which are still missing
    device = tmp_path / "device"
    device.mkdir()
    shutil.copy(tmp_path / "stage" / stage.MANIFEST, device)
    (device / stage.PARTS).mkdir()
    for index, part in enumerate(parts):
        assert stage.main(["check", str(device)]) == stage.MISSING
        shutil.copy(tmp_path / "stage" / stage.PARTS / part["name"], device / stage.PARTS)
        if index == 0:  # a part damaged on the way is refused, and carried again
            damaged = device / stage.PARTS / part["name"]
            damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
            assert stage.missing_parts(device)[1] == [p["name"] for p in parts]
            shutil.copy(tmp_path / "stage" / stage.PARTS / part["name"], device / stage.PARTS)
    assert stage.main(["check", str(device)]) == 0
    model = device / stage.TARGET / "tiny"
    assert stage.weights_digest(stage.read_weights(model)) == stage.weights_digest(stage.read_weights(chat_model_dir))

    out, run = tmp_path / "out", tmp_path / "run"
    result = invoke(["schedule=gpu", "target=hf", f"target.path={model}", f"data.sequences={device / 'payload' / stage.SEQUENCES}",
                     "schedule.methods=[eagle3]", "schedule.shares=[1]", *TINY_SETTINGS, *EAGLE3_LAYERS, f"output={out}",
                     f"hydra.run.dir={run}"], capsys)
    assert result.code == 0, result
    shutil.copy(run / "train_results.json", out / "results.json")
    results = check_results(out, ["eagle3"])
    assert results["own_answers"]["sequences"] == 30 and results["own_answers"]["answer_tokens"] > 0
    assert json.loads((out / "eagle3" / "config.json").read_text())["training"]["steps"] == 2
    check_checkpoints_draft(out, chat_model_dir, ["eagle3"])


def test_the_trainer_stops_at_its_deadline_with_a_complete_checkpoint(tmp_path):
    from drafters.training.trainer import TrainConfig, latest_checkpoint, train

    model = torch.nn.Linear(4, 1)
    data = torch.randn(8, 4)

    def batches(step):
        while True:
            time.sleep(0.01)
            yield data

    config = TrainConfig(steps=10_000, checkpoint_every=10_000, log_every=10_000)
    reached = train(model, batches, lambda x: (model(x).pow(2).mean(), {}), config, tmp_path, deadline=time.monotonic() + 0.3)
    assert 1 <= reached < 10_000 and latest_checkpoint(tmp_path)[0] == reached


@pytest.mark.parametrize("overrides, message", [
    (["schedule.methods=[eagle3,nope]", "schedule.shares=[1,1]"], "no configs/train/nope.yaml"),
    (["schedule.methods=[medusa]", "schedule.shares=[1]"], "train=medusa trains on cached features only"),
    (["schedule.shares=[1,1]"], "one positive share per method"),
    (["+schedule.train.eagle3.unrol=2"], "unknown setting"),
    (["+schedule.train.nope.unroll=2"], "schedule.train.nope: not one of schedule.methods"),
    (["schedule.budget_s=0"], "schedule.budget_s must be > 0"),
    (["features=cached"], "schedule= trains with features=online"),
    (["data.sequences=/nowhere.npz"], "data.sequences=/nowhere.npz: no such file"),
])
def test_bad_schedule_settings_are_refused_in_one_line_before_anything_loads(tmp_path, capsys, overrides, message):
    result = invoke(["schedule=gpu", *overrides, f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert result.code == 2 and result.err.count("\n") == 1 and message in result.err, result
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_device_script_delivers_parts_then_trains_every_head(tmp_path, chat_model_dir):
    """scripts/gpu_train.sh as the device runs it, call by call (python3 = this interpreter), with
    EAGLE-3, MTP and Domino; each checkpoint drafts exactly."""
    manifest = stage_tiny(chat_model_dir, tmp_path / "stage")
    staged = tmp_path / "device"
    (staged / stage.PARTS).mkdir(parents=True)
    shutil.copy(tmp_path / "stage" / stage.MANIFEST, staged)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "STAGED": str(staged),
           "OUT": str(out), "BUDGET": "120"}
    settings = [f"target.path={staged / stage.TARGET / 'tiny'}", *TINY_SETTINGS, *EAGLE3_LAYERS, *DOMINO_SIZES]
    for part in manifest["parts"]:
        shutil.copy(tmp_path / "stage" / stage.PARTS / part["name"], staged / stage.PARTS)
        call = subprocess.run(["bash", str(REPO / "scripts" / "gpu_train.sh"), *settings], env=env,
                              capture_output=True, text=True, timeout=600)
        assert call.returncode == 0, call.stdout + call.stderr
        last = part is manifest["parts"][-1]
        assert ("waiting for the parts" in call.stdout) != last and ("done in" in call.stdout) == last
    check_results(out, ["eagle3", "mtp", "domino"])
    assert (out / "train.log").read_text().count(" step 2/2 ") == 3
    check_checkpoints_draft(out, chat_model_dir, ["eagle3", "mtp", "domino"])


def test_the_staging_measures_the_repository_root():
    """plan and stage size the parts by what a call carries: the whole tree, not the folder the
    module sits in."""
    assert (stage.REPO / "pyproject.toml").is_file() and (stage.REPO / "scripts" / "gpu_train.sh").is_file()
    assert stage.tree_bytes(stage.REPO) > stage.MIB


def test_slim_leaves_the_bundled_checkpoints_out_of_the_calls_and_unslim_restores_the_index(tmp_path, capsys):
    """A device call carries git's tracked and untracked-not-ignored files: slim takes the bundled
    heads out of both (the files stay), so a training call's parts grow, but for those it keeps;
    unslim leaves git as it found it."""
    repo = tmp_path / "repo"
    (repo / slim.SLIM).mkdir(parents=True)
    (repo / slim.SLIM / "head.safetensors").write_bytes(b"\0" * 3 * stage.MIB)
    (repo / "code.py").write_text("print(1)\n")

    def git(*arguments: str) -> str:
        return subprocess.run(["git", *arguments], cwd=repo, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "empty")
    git("add", ".")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "-m", "tree")
    (repo / ".git" / "info" / "exclude").write_text("# mine\n/scratch/")  # no final newline
    before = stage.tree_bytes(repo)

    slim.slim(repo)
    assert slim.is_slim(repo) and stage.tree_bytes(repo) == before - 3 * stage.MIB
    assert (repo / slim.SLIM / "head.safetensors").stat().st_size == 3 * stage.MIB  # still on disk
    assert git("ls-files", "--cached", "--others", "--exclude-standard").split() == ["code.py"]
    slim.slim(repo)  # twice is once
    assert (repo / ".git" / "info" / "exclude").read_text().count(slim.SLIM_NOTE) == 1

    slim.unslim(repo)
    assert not slim.is_slim(repo) and stage.tree_bytes(repo) == before
    assert git("status", "--porcelain") == ""
    assert (repo / ".git" / "info" / "exclude").read_text() == "# mine\n/scratch/\n"

    (repo / slim.SLIM / "kept").mkdir()  # a head the call drafts with stays in the call
    (repo / slim.SLIM / "kept" / "model.safetensors").write_bytes(b"\0" * stage.MIB)
    git("add", ".")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "-m", "kept")
    with pytest.raises(ValueError, match="--keep nothing: no such folder in drafters/checkpoints \\(it has head.safetensors, kept\\)"):
        slim.slim(repo, ("nothing",))
    assert not slim.is_slim(repo)
    slim.slim(repo, ("kept",))
    assert git("ls-files", "--cached", "--others", "--exclude-standard").split() == [
        "code.py", f"{slim.SLIM}/kept/model.safetensors"]
    slim.unslim(repo)
    assert git("status", "--porcelain") == "" and (repo / ".git" / "info" / "exclude").read_text() == "# mine\n/scratch/\n"

    (repo / "code.py").write_text("print(2)\n")
    git("add", "code.py")
    with pytest.raises(ValueError, match="the index holds staged changes \\(code.py"):
        slim.slim(repo)
    assert not slim.is_slim(repo) and "head.safetensors" in git("ls-files")
