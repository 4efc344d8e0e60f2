"""bf16 adapters with fp32 masters: ``MasterAdamW`` against torch's AdamW on fp32 copies, FoRAOptimizer's master
groups, and their state through ``state_dict``, accelerate's ``save_state`` and edits of the parameters."""

import copy

import pytest
import torch
from conftest import TARGETS, tiny_llama
from peft import LoraConfig, get_peft_model

from fora_plugin import FoRAOptimizer, build_fora_optimizer, create_fora_optimizer, make_stiefel
from fora_plugin.optim import MasterAdamW, fora_optimizer_parts
from fora_plugin.stiefel import orthogonality_error, random_stiefel


FLAGS = [{"foreach": False}, {"foreach": True}, {"fused": True}]


def bf16_and_reference(shapes, seed):
    """bf16 parameters, and fp32 parameters holding the same values (what an fp32 adapter would be)."""
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(shape, generator=gen).bfloat16() for shape in shapes]
    return [torch.nn.Parameter(v.clone()) for v in values], [torch.nn.Parameter(v.float()) for v in values]


def set_grads(bf16, fp32, gen):
    for p, q in zip(bf16, fp32):
        g = torch.randn(p.shape, generator=gen).bfloat16()  # a bf16 backward's gradient
        p.grad, q.grad = g.clone(), g.float()


@pytest.mark.parametrize("flags", FLAGS, ids=str)
def test_masters_step_bit_for_bit_as_torch_adamw_on_fp32_parameters(flags):
    bf16, fp32 = bf16_and_reference([(4, 16), (8, 4), (5,)], seed=0)
    plain = [torch.nn.Parameter(p.detach().clone()) for p in bf16]  # torch's AdamW on the bf16 weights themselves
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, **flags)
    optimizers = [MasterAdamW(bf16, **kwargs), torch.optim.AdamW(fp32, **kwargs), torch.optim.AdamW(plain, **kwargs)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        set_grads(bf16, fp32, gen)
        for p, q in zip(plain, bf16):
            p.grad = q.grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    optimizer, reference, _ = optimizers
    for p, q in zip(bf16, fp32):
        state = optimizer.state[p]
        assert {state[k].dtype for k in ("master", "exp_avg", "exp_avg_sq")} == {torch.float32}
        assert torch.equal(state["master"], q)  # the fp32 adapter's trajectory, to the bit
        assert torch.equal(state["exp_avg"], reference.state[q]["exp_avg"])
        assert torch.equal(p, q.bfloat16())  # the parameter is its master rounded
        assert p.untyped_storage().data_ptr() != state["master"].untyped_storage().data_ptr()
    # AdamW on the bf16 weights rounds every update into them: it leaves the fp32 trajectory.
    assert not all(torch.equal(p, q.bfloat16()) for p, q in zip(plain, fp32))


def test_fp32_parameters_in_a_master_group_step_as_torch_adamw():
    gen = torch.Generator().manual_seed(2)
    p = torch.nn.Parameter(torch.randn(6, 10, generator=gen))
    q = torch.nn.Parameter(p.detach().clone())
    optimizer, reference = MasterAdamW([p], lr=1e-2, amsgrad=True), torch.optim.AdamW([q], lr=1e-2, amsgrad=True)
    for _ in range(4):
        g = torch.randn(p.shape, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
    assert torch.equal(p, q) and "master" not in optimizer.state[p]


def build(a, b, master_weights=True):
    return FoRAOptimizer(
        [{"params": a, "weight_decay": 0.1, "master_weights": master_weights}, {"params": [b], "stiefel": True}],
        adamw_defaults={"lr": 1e-2},
        stiefel_defaults={"lr": 5e-2, "qr_period": 3},
    )


def test_fora_optimizer_masters_resume_bit_identically_and_own_their_storage():
    gen = torch.Generator().manual_seed(3)
    a, _ = bf16_and_reference([(4, 9), (4, 12)], seed=4)
    b = torch.nn.Parameter(random_stiefel(9, 4, generator=gen).bfloat16())
    optimizer = build(a, b)
    for _ in range(4):
        set_grads([*a, b], [torch.empty_like(p, dtype=torch.float32) for p in [*a, b]], gen)
        optimizer.step()
    a2 = [torch.nn.Parameter(p.detach().clone()) for p in a]
    b2 = torch.nn.Parameter(b.detach().clone())
    saved = optimizer.state_dict()
    resumed = build(a2, b2)
    resumed.load_state_dict(saved)
    for p in [*a2, b2]:
        state = resumed.state[p]
        assert state["master"].dtype == state["exp_avg"].dtype == torch.float32
        assert all(t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for t in state.values())
    assert not any(
        resumed.state[p][k].untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        for p, i in zip(a2, saved["param_groups"][0]["params"])
        for k, v in saved["state"][i].items()
    )
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=gen).bfloat16() for p in [*a, b]]
        for p, q, g in zip([*a, b], [*a2, b2], grads):
            p.grad, q.grad = g.clone(), g.clone()
        optimizer.step()
        resumed.step()
    assert all(torch.equal(p, q) for p, q in zip([*a, b], [*a2, b2]))
    assert all(torch.equal(optimizer.state[p]["master"], resumed.state[q]["master"]) for p, q in zip(a, a2))
    assert orthogonality_error(resumed.state[b2]["master"]) < 1e-5


def test_loading_a_state_adds_no_entry_for_a_parameter_without_state():
    # accelerate's AcceleratedOptimizer loads the optimizer's own (empty) state_dict when it wraps it, and FSDP2 swaps
    # the parameters for sharded ones afterwards: an entry keyed by an old parameter would break state_dict().
    gen = torch.Generator().manual_seed(9)
    a, _ = bf16_and_reference([(4, 9)], seed=10)
    b = torch.nn.Parameter(random_stiefel(9, 4, generator=gen).bfloat16())
    optimizer = build(a, b)
    optimizer.load_state_dict(copy.deepcopy(build(a, b).state_dict()))
    assert len(optimizer.state) == 0
    a[0].grad, b.grad = torch.randn(4, 9, generator=gen).bfloat16(), torch.randn(9, 4, generator=gen).bfloat16()
    optimizer.step()
    assert len(optimizer.state) == 2 and len(optimizer.state_dict()["state"]) == 2


def test_a_checkpoint_of_fp32_adapters_resumed_with_bf16_ones_keeps_this_runs_masters():
    gen = torch.Generator().manual_seed(5)
    (a,), (a32,) = bf16_and_reference([(4, 9)], seed=6)
    b = torch.nn.Parameter(random_stiefel(9, 4, generator=gen))
    fp32_run = build([a32], b, master_weights=False)
    a32.grad, b.grad = torch.randn(4, 9, generator=gen), torch.randn(9, 4, generator=gen)
    fp32_run.step()
    resumed = build([a], torch.nn.Parameter(b.detach().bfloat16()))
    resumed.load_state_dict(copy.deepcopy(fp32_run.state_dict()))
    assert resumed.param_groups[0]["master_weights"]
    a.grad = torch.randn(4, 9, generator=gen).bfloat16()
    resumed.step()
    state = resumed.state[a]
    assert state["master"].dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(a, state["master"].bfloat16())


def test_a_checkpoint_of_bf16_adapters_resumed_with_fp32_ones_leaves_no_stale_master():
    # torch's AdamW steps fp32 adapters: a master loaded beside its state would be saved again at every checkpoint.
    gen = torch.Generator().manual_seed(7)
    (a,), (a32,) = bf16_and_reference([(4, 9)], seed=8)
    b = torch.nn.Parameter(random_stiefel(9, 4, generator=gen))
    bf16_run = build([a], torch.nn.Parameter(b.detach().bfloat16()))
    a.grad = torch.randn(4, 9, generator=gen).bfloat16()
    bf16_run.step()
    assert "master" in bf16_run.state[a]
    resumed = build([a32], b, master_weights=False)
    resumed.load_state_dict(copy.deepcopy(bf16_run.state_dict()))
    assert "master" not in resumed.state[a32] and resumed.state[a32]["exp_avg"].dtype == torch.float32
    a32.grad = torch.randn(4, 9, generator=gen)
    resumed.step()
    assert "master" not in resumed.state_dict()["state"][0]


def test_a_parameter_loaded_in_place_is_where_the_next_step_starts():
    gen = torch.Generator().manual_seed(7)
    (p,), _ = bf16_and_reference([(4, 8)], seed=8)
    optimizer = MasterAdamW([p], lr=1e-2)
    p.grad = torch.randn(4, 8, generator=gen).bfloat16()
    optimizer.step()
    master = optimizer.state[p]["master"].clone()
    with torch.no_grad():
        p[0].fill_(3.0)  # a user's edit of one row
    p.grad = torch.zeros_like(p)
    optimizer.param_groups[0]["lr"] = 0.0
    optimizer.step()
    after = optimizer.state[p]["master"]
    assert torch.equal(after[0], torch.full((8,), 3.0)) and torch.equal(after[1:], master[1:])  # extra bits kept


def test_fora_optimizer_parts_marks_only_the_adamw_groups():
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=TARGETS))
    make_stiefel(model, generator=torch.Generator().manual_seed(0))
    groups, _, _ = fora_optimizer_parts(model, master_weights=True)
    assert [bool(g.get("master_weights")) for g in groups] == [True, False]
    assert [bool(g.get("stiefel")) for g in groups] == [False, True]
    groups, _, _ = fora_optimizer_parts(model)
    assert not any(g.get("master_weights") for g in groups)


def test_accelerate_save_state_resumes_bf16_adapters_with_their_masters(tmp_path):
    from accelerate import Accelerator

    def run(first: int, load: bool) -> dict[str, torch.Tensor]:
        accelerator = Accelerator(cpu=True)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, layers_to_transform=[1, 3])
        model = get_peft_model(tiny_llama().to(torch.bfloat16).train(), config, autocast_adapter_dtype=False)
        make_stiefel(model, generator=torch.Generator().manual_seed(0))
        optimizer = build_fora_optimizer(model, lr=1e-2, lr_stiefel=5e-2, master_weights=True)
        model, optimizer = accelerator.prepare(model, optimizer)
        if load:
            accelerator.load_state(tmp_path / "checkpoint")
        for step in range(first, 6):
            ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(100 + step))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if not load and step == 2:
                accelerator.save_state(tmp_path / "checkpoint")
        lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert {p.dtype for p in lora.values()} == {torch.bfloat16} and len(lora) == 20
        masters = {n: optimizer.state[p]["master"] for n, p in lora.items()}
        assert all(torch.equal(lora[n], m.bfloat16()) and m.dtype == torch.float32 for n, m in masters.items())
        return {n: m.clone() for n, m in masters.items()}

    assert all(torch.equal(a, b) for a, b in zip(run(0, False).values(), run(3, True).values()))


def stiefel_llama(seed: int = 0):
    torch.manual_seed(seed)
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=TARGETS))
    make_stiefel(model, generator=torch.Generator().manual_seed(seed))
    return model


def test_create_fora_optimizer_takes_every_setting_by_keyword_and_steps_as_build_fora_optimizer():
    settings = dict(
        lr=1e-2,
        lr_stiefel=5e-2,
        weight_decay=0.01,
        betas=(0.8, 0.9),
        eps=1e-7,
        stiefel_betas=(0.7, 0.95),
        stiefel_eps=1e-6,
        qr_period=2,
        cayley_iters=3,
        reproject_threshold=1e-4,
        foreach=False,
    )
    created_model, built_model = stiefel_llama(), stiefel_llama()
    created = create_fora_optimizer(created_model, **settings)
    built = build_fora_optimizer(built_model, **settings)  # the reference: the positional-and-kwargs entry point
    assert isinstance(created, FoRAOptimizer)
    assert [{k: v for k, v in g.items() if k != "params"} for g in created.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in built.param_groups
    ]
    start = {n: p.detach().clone() for n, p in created_model.named_parameters() if p.requires_grad}
    batch = {"input_ids": torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(1))}
    for model, optimizer in ((created_model, created), (built_model, built)):
        for _ in range(3):
            model(**batch, labels=batch["input_ids"]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), (_, b) in zip(created_model.named_parameters(), built_model.named_parameters()):
        assert torch.equal(a, b), name
    assert all(not torch.equal(p, start[n]) for n, p in created_model.named_parameters() if n in start)  # it trained
    with pytest.raises(TypeError):
        create_fora_optimizer(created_model, 1e-3, 1e-3)  # no positional settings
    with pytest.raises(TypeError):
        create_fora_optimizer(created_model, lr=1e-3)  # lr_stiefel is required: no silent default
    with pytest.raises(TypeError):
        create_fora_optimizer(created_model, lr=1e-3, lr_stiefel=1e-3, momentum=0.9)  # nothing passes unread


def test_create_fora_optimizer_has_the_defaults_of_fora_optimizer_parts():
    import inspect

    explicit = inspect.signature(create_fora_optimizer).parameters
    flexible = inspect.signature(fora_optimizer_parts).parameters
    assert all(p.kind is p.KEYWORD_ONLY for name, p in explicit.items() if name != "model")
    assert explicit["lr"].default is explicit["lr_stiefel"].default is inspect.Parameter.empty  # required
    shared = set(explicit) & set(flexible) - {"model", "lr", "lr_stiefel"}
    assert set(explicit) - set(flexible) == {"foreach", "fused"}  # AdamW's flags, which build_fora_optimizer passes on
    assert {name: explicit[name].default for name in shared} == {name: flexible[name].default for name in shared}
