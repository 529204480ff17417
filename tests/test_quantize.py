"""Weight-only fake quantization of drafters (study e)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from drafters.draft_model import DraftModelDrafter
from drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from drafters.heads import save_head
from drafters.ngram import NgramDrafter
from drafters.quantize import Int8Linear, quantize_drafter, quantize_rows
from drafters.union import UnionDrafter
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers import reference


@pytest.mark.parametrize("scheme,levels", [("int8", 255), ("int4", 15)])
def test_integer_grids_have_the_promised_levels_per_row(scheme, levels):
    w = torch.randn(6, 200)
    q = quantize_rows(w, scheme)
    for row, original in zip(q, w):
        assert len(torch.unique(row)) <= levels
        assert torch.isclose(row.abs().max(), original.abs().max())  # the row's peak is on the grid
    error = lambda s: float((quantize_rows(w, s) - w).norm() / w.norm())
    assert error("int8") < 0.01 < error("int4") < 0.2 and error("fp8") < 0.05


def test_zero_rows_and_dtype_survive():
    w = torch.zeros(3, 4, dtype=torch.float16)
    assert torch.equal(quantize_rows(w, "fp8"), w) and quantize_rows(w, "int4").dtype == torch.float16


def test_only_the_drafters_own_weights_change_and_decoding_stays_exact():
    model = tiny_model("llama", sharpness=4.0)
    target = HFTarget(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target)).eval()
    drafter = EagleDrafter(target, head, depth=3)
    fc = head.fc.weight.clone()
    report = quantize_drafter(drafter, target, "int4")
    assert report.tensors > 0 and 0.01 < report.relative_error < 0.2 and not torch.equal(head.fc.weight, fc)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the target is untouched
    prompts = [[1, 2, 3], [4, 5]]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 12, SamplingParams(0.0))
    assert SpecDecoder(target, drafter, reference.verify).generate(prompts, 12, SamplingParams(0.0)).outputs == plain.outputs


def test_a_drafter_without_weights_of_its_own_is_a_clear_error():
    target = HFTarget(tiny_model("llama"))
    with pytest.raises(ValueError, match="no weights of its own"):
        quantize_drafter(NgramDrafter(target), target, "int8")
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        quantize_drafter(NgramDrafter(target), target, "int3")


@pytest.mark.integration
def test_a_union_quantizes_its_members_own_weights_and_a_draft_model_its_model(tmp_path):
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    save_head(EagleHead(EagleConfig.for_target(target)).eval(), tmp_path / "head")
    union = UnionDrafter(target, [{"name": "eagle", "checkpoint": str(tmp_path / "head"), "depth": 2}, {"name": "ngram"}])
    head = union.members[0][1].head
    assert union.quantizable() == [head]
    matrices = [p for p in head.parameters() if p.dim() >= 2]  # fc, qkv, out, gate_up, down
    assert quantize_drafter(union, target, "int8").tensors == len(matrices) == 5
    draft = tiny_model("llama", sharpness=2.0)
    report = quantize_drafter(DraftModelDrafter(target, model=draft), target, "int8")
    assert report.tensors == len({id(p) for p in draft.parameters() if p.dim() >= 2})


def test_int8_kernels_run_the_int8_grid_on_real_int8_linears_and_decoding_stays_exact():
    model = tiny_model("llama", sharpness=4.0)
    target = HFTarget(model)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target)).eval()
    twin = EagleHead(EagleConfig.for_target(target)).eval()
    twin.load_state_dict(head.state_dict())
    fake = quantize_drafter(EagleDrafter(target, twin, depth=3), target, "int8")
    drafter = EagleDrafter(target, head, depth=3)
    real = quantize_drafter(drafter, target, "int8_kernels")
    linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    int8 = [m for m in head.modules() if isinstance(m, Int8Linear)]
    assert not linears and len(int8) == real.tensors == fake.tensors
    assert real.relative_error == pytest.approx(fake.relative_error, rel=1e-4)  # the same weight grid
    assert torch.equal(int8[0].weight().dequantize(), twin.fc.weight)  # bit for bit: fc is the first linear
    prompts = [[1, 2, 3], [4, 5]]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 12, SamplingParams(0.0))
    spec = SpecDecoder(target, drafter, reference.verify).generate(prompts, 12, SamplingParams(0.0))
    assert spec.outputs == plain.outputs and spec.stats.num_steps < 24  # it drafted, and drafts were accepted


def test_int8_kernels_refuse_a_drafter_off_float32():
    target = HFTarget(tiny_model("llama"))
    head = EagleHead(EagleConfig.for_target(target)).eval().to(torch.bfloat16)
    with pytest.raises(ValueError, match="int8_kernels runs torch's int8 CPU kernels, which take a float32 drafter"):
        quantize_drafter(EagleDrafter(target, head, depth=2), target, "int8_kernels")
