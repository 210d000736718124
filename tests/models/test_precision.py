"""model.precision=auto: bf16 only where the hardware has fast bf16 kernels, else fp32; bad values fail in one line."""

from __future__ import annotations

import pytest
import torch

from flowcredit.config.schema import ModelCfg
from flowcredit.models import precision as prec
from flowcredit.models.factory import build_model


def test_explicit_precisions_pass_through():
    assert prec.resolve_precision("fp32") == "fp32"
    assert prec.resolve_precision("bf16") == "bf16"


@pytest.mark.parametrize("fast, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_follows_the_hardware_check(monkeypatch, fast, expected):
    monkeypatch.setattr(prec, "fast_bf16", lambda device="cpu": fast)
    assert prec.resolve_precision("auto", "cpu") == expected


def test_cpu_check_is_onednn_bf16_support():
    assert prec.fast_bf16("cpu") == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_cpu_check_without_the_onednn_op_is_false(monkeypatch):
    class NoOps:
        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(torch.ops, "mkldnn", NoOps())
    assert prec.fast_bf16("cpu") is False


def test_cuda_without_a_gpu_and_other_devices_are_not_fast(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert prec.fast_bf16("cuda") is False
    assert prec.fast_bf16("meta") is False


def test_bad_value_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"model.precision='fp16'; valid: auto, fp32, bf16"):
        prec.resolve_precision("fp16")


@pytest.mark.parametrize("fast", [True, False])
def test_build_model_resolves_auto_in_place(monkeypatch, fast):
    monkeypatch.setattr(prec, "fast_bf16", lambda device="cpu": fast)
    cfg = ModelCfg(name="tiny", precision="auto")
    model = build_model(cfg)
    assert cfg.precision == ("bf16" if fast else "fp32")  # the saved config records what ran
    assert model.compute_dtype == (torch.bfloat16 if fast else torch.float32)
