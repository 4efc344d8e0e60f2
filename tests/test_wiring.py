"""PEFT's input cast under autocast (``set_input_cast``) and the adapters' dtype (``readapt_lora``): a tiny Llama."""

import pytest
import torch
from conftest import TARGETS, tiny_llama
from peft import LoraConfig, get_peft_model
from peft.tuners import tuners_utils

from fora_plugin import FoRAConfig
from fora_plugin.fisher import fisher_scores
from fora_plugin.selection import FoRASelection
from fora_plugin.wiring import readapt_lora, set_input_cast


TOKENS = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))


class CastCounter:
    """Counts the copies PEFT's ``_cast_input_dtype`` makes (a call that returns its input unchanged makes none)."""

    def __init__(self, monkeypatch) -> None:
        self.copies = 0
        original = tuners_utils.BaseTunerLayer._cast_input_dtype

        def counting(layer, x, dtype):
            out = original(layer, x, dtype)
            self.copies += out is not x
            return out

        monkeypatch.setattr(tuners_utils.BaseTunerLayer, "_cast_input_dtype", counting)


def peft_llama(dtype=torch.bfloat16, dropout=0.0, cast="auto", layers=None):
    """A bf16 tiny Llama with fp32 LoRA (PEFT's default) on every target, A and B both non-zero."""
    model = tiny_llama().to(dtype)
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS, init_lora_weights="gaussian")
    config.layers_to_transform = layers
    peft_model = get_peft_model(model, config)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(2))
    set_input_cast(peft_model, cast)
    return peft_model.train()


def lora_grads(model, autocast=True) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)  # the same dropout masks
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=TOKENS, labels=TOKENS).loss
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def distance(a: dict, b: dict) -> float:
    """‖a − b‖ / ‖b‖ over all gradients together."""
    diff = torch.cat([(a[k].float() - b[k].float()).flatten() for k in b])
    return (diff.norm() / torch.cat([b[k].float().flatten() for k in b]).norm()).item()


def test_gradients_are_identical_with_the_cast_on_and_off_under_bf16_autocast(monkeypatch):
    counter = CastCounter(monkeypatch)
    model = peft_llama(cast="peft")
    assert next(p.dtype for n, p in model.named_parameters() if "lora_A" in n) == torch.float32
    on = lora_grads(model)
    assert counter.copies == 4 * len(TARGETS)  # every LoRA layer copied its bf16 input to fp32
    counter.copies = 0
    off = lora_grads(peft_llama(cast="auto"))
    assert counter.copies == 0
    assert on.keys() == off.keys() and len(on) == 2 * 4 * len(TARGETS)
    assert all(torch.equal(on[k], off[k]) for k in on)


def test_with_dropout_the_difference_is_within_bf16_rounding():
    # The dropout masks are the same; the scaled inputs differ by one bf16 rounding, which a bf16 backward carries
    # into every gradient: the cast changes them less than bf16 itself does (against the same model in fp32).
    on, off = lora_grads(peft_llama(dropout=0.1, cast="peft")), lora_grads(peft_llama(dropout=0.1, cast="auto"))
    reference = lora_grads(peft_llama(torch.float32, dropout=0.1, cast="peft"), autocast=False)
    assert not all(torch.equal(on[k], off[k]) for k in on)
    assert distance(on, off) <= 1.5 * max(distance(on, reference), distance(off, reference))
    assert distance(on, reference) < 0.05 and distance(off, reference) < 0.05


def test_without_autocast_peft_casts_as_before(monkeypatch):
    # A bf16 input meets fp32 adapter weights outside autocast (evaluation, generate): PEFT's cast makes the matmul
    # possible, and the hook leaves it on there.
    counter = CastCounter(monkeypatch)
    model = peft_llama(cast="auto")
    with torch.no_grad():
        logits = model(input_ids=TOKENS).logits
    assert counter.copies == 4 * len(TARGETS) and logits.dtype == torch.bfloat16
    generated = model.generate(input_ids=TOKENS[:1, :4], max_new_tokens=2, do_sample=False)
    assert generated.shape == (1, 6)


def test_setting_it_again_replaces_the_hook_and_peft_takes_it_off():
    model = peft_llama(cast="auto")
    base = model.get_base_model()
    hooks = lambda: [h for h in base._forward_pre_hooks.values() if type(h).__name__ == "_InputCastUnderAutocast"]  # noqa: E731
    assert set_input_cast(model, "auto") == 4 * len(TARGETS) and len(hooks()) == 1
    assert set_input_cast(model, "peft") == 0 and not hooks()
    assert all(m.cast_input_dtype_enabled for m in model.modules() if hasattr(m, "cast_input_dtype_enabled"))
    with pytest.raises(ValueError, match=r"input_cast='off' is invalid: use one of \('auto', 'peft'\)"):
        set_input_cast(model, "off")


def test_dora_layers_keep_peft_cast():
    model = get_peft_model(tiny_llama().to(torch.bfloat16), LoraConfig(r=4, target_modules=TARGETS, use_dora=True))
    assert set_input_cast(model, "auto") == 0


def test_scoring_makes_no_input_copy(monkeypatch):
    # Scoring runs with the adapters off: LoRA layers call their base layer only, so there is nothing to cast.
    counter = CastCounter(monkeypatch)
    model = peft_llama(cast="peft")
    scores = fisher_scores(
        model,
        [{"input_ids": TOKENS, "labels": TOKENS}],
        1,
        autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        progress=False,
    )
    assert counter.copies == 0 and all(s > 0 for s in scores.scores)


def readapted_dtypes(adapter_dtype: str, trl_zero3: bool = False) -> dict[str, torch.dtype]:
    # Under ZeRO-3 TRL wraps with autocast_adapter_dtype=False (adapters in the base's bf16), and so does FoRA.
    config = LoraConfig(r=4, target_modules=TARGETS)
    model = get_peft_model(tiny_llama().to(torch.bfloat16), config, autocast_adapter_dtype=not trl_zero3)
    fora = FoRAConfig(adapter_dtype=adapter_dtype)
    readapt_lora(model, FoRASelection([1, 3], 4, "model.layers"), fora, seed=0, autocast_adapter_dtype=not trl_zero3)
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    return {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}


def test_readapt_gives_the_adapters_the_dtype_asked_for():
    fp32, bf16 = readapted_dtypes("auto"), readapted_dtypes("bfloat16")
    assert fp32.keys() == bf16.keys() and len(fp32) == 2 * 2 * len(TARGETS)
    assert set(fp32.values()) == {torch.float32} and set(bf16.values()) == {torch.bfloat16}
    # ZeRO-3's path and the bf16 option are one: PEFT asked for the base's dtype.
    assert readapted_dtypes("auto", trl_zero3=True) == readapted_dtypes("bfloat16", trl_zero3=True) == bf16
