"""Memory preflight (trainer/preflight.py): a batch too large for memory fails before training, in one line with
the estimate; the shipped presets never trip it on a normal machine."""

import pytest
import torch

from flowcredit.config.resolve import PRESET_DIR, resolve_train_config
from flowcredit.models.factory import build_model, set_trainable
from flowcredit.trainer import preflight

TINY_PRESETS = sorted(p.stem for p in PRESET_DIR.glob("tiny_*.yaml"))


def _built(args):
    cfg, _ = resolve_train_config(args)
    model = build_model(cfg.model, "cpu")
    set_trainable(model, cfg.model.trainable)
    return cfg, model


def test_available_bytes_cpu_is_positive():
    avail = preflight.available_bytes("cpu")
    assert avail is not None and avail > 0


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_shipped_tiny_presets_pass_and_stay_small(preset):
    cfg, model = _built([preset])
    est = preflight.check_memory(cfg, model, "cpu")  # the real available memory: must not raise
    assert est is not None
    assert est.needed + est.weights < 3e9, preflight.describe_estimate(est)


def test_too_large_batch_fails_with_one_line_estimate(monkeypatch):
    cfg, model = _built(["tiny_flow_grpo"])
    monkeypatch.setattr(preflight, "available_bytes", lambda device: 50e6)  # 50 MB "available"
    with pytest.raises(ValueError) as ei:
        preflight.check_memory(cfg, model, "cpu")
    msg = str(ei.value)
    assert "\n" not in msg
    for part in ("GB", "grads", "AdamW", "rollout", "activations", "0.05 GB is available", "optim.micro_batch",
                 "data.group_size", "data.prompts_per_iter", "model.gradient_checkpointing=true"):
        assert part in msg, (part, msg)


def test_margin_decides_at_the_boundary(monkeypatch):
    cfg, model = _built(["tiny_flow_grpo"])
    est = preflight.estimate_memory(cfg, model, "cpu")
    monkeypatch.setattr(preflight, "available_bytes", lambda device: est.needed * 1.1)
    preflight.check_memory(cfg, model, "cpu", margin=1.0)  # fits without a margin
    with pytest.raises(ValueError, match="x1.25 margin"):
        preflight.check_memory(cfg, model, "cpu")  # not with the default 1.25


def test_activations_scale_with_micro_batch_and_fixes_lower_the_estimate():
    _, model = _built(["tiny_flow_grpo"])
    big, _ = resolve_train_config(["tiny_flow_grpo", "optim.micro_batch=128"])
    small, _ = resolve_train_config(["tiny_flow_grpo", "optim.micro_batch=16"])
    e_big, e_small = preflight.estimate_memory(big, model, "cpu"), preflight.estimate_memory(small, model, "cpu")
    assert e_big.micro_batch == 128 and e_small.micro_batch == 16
    assert e_big.activations > 5 * e_small.activations
    # micro_batch never exceeds the pairs of one optimizer step (B × trained steps)
    huge, _ = resolve_train_config(["tiny_flow_grpo", "optim.micro_batch=100000"])
    assert preflight.estimate_memory(huge, model, "cpu").micro_batch == 64 * 3
    # a smaller group shrinks the rollout
    g2, _ = resolve_train_config(["tiny_flow_grpo", "data.group_size=2"])
    assert preflight.estimate_memory(g2, model, "cpu").rollout < e_big.rollout / 3


def test_gradient_checkpointing_lowers_the_measured_activations():
    from flowcredit.trainer.memory import enable_gradient_checkpointing

    cfg, model = _built(["tiny_flow_grpo", "optim.micro_batch=64"])
    plain = preflight.estimate_memory(cfg, model, "cpu").per_pair
    enable_gradient_checkpointing(model)
    ckpt = preflight.estimate_memory(cfg, model, "cpu").per_pair
    assert ckpt < plain / 2


def test_probe_leaves_rng_and_grads_untouched():
    cfg, model = _built(["tiny_flow_grpo", "sampler.guidance_scale=4.5"])  # CFG branch of the probe too
    preflight._PROBE_CACHE.clear()
    state = torch.get_rng_state()
    est = preflight.estimate_memory(cfg, model, "cpu")
    assert torch.equal(state, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    assert est.per_pair > 0


def test_env_skips_the_check(monkeypatch):
    cfg, model = _built(["tiny_flow_grpo"])
    monkeypatch.setattr(preflight, "available_bytes", lambda device: 1.0)
    monkeypatch.setenv(preflight.SKIP_ENV, "1")
    assert preflight.check_memory(cfg, model, "cpu") is None


def test_unknown_available_memory_skips(monkeypatch):
    cfg, model = _built(["tiny_flow_grpo"])
    monkeypatch.setattr(preflight, "available_bytes", lambda device: None)
    assert preflight.check_memory(cfg, model, "cpu") is None


def test_kl_reference_copy_is_counted_unless_already_loaded():
    cfg, model = _built(["tiny_flow_grpo", "optim.kl_beta=0.04"])
    base, _ = resolve_train_config(["tiny_flow_grpo"])
    weights = preflight.estimate_memory(base, model, "cpu").weights
    with_ref = preflight.estimate_memory(cfg, model, "cpu").copies
    assert with_ref - preflight.estimate_memory(base, model, "cpu").copies == pytest.approx(weights)
    assert preflight.estimate_memory(cfg, model, "cpu", reference_loaded=True).copies < with_ref
