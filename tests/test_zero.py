"""FoRA under DeepSpeed ZeRO-1/2: two CPU ranks over gloo against a single-process run of the same global batches."""

import inspect
import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import TARGETS, char_tokenizer, tiny_llama, tiny_llama_config
from peft import LoraConfig, PeftModel, get_peft_model

from fora_plugin import FoRAConfig, make_stiefel
from fora_plugin.adapter import expert_blocks
from fora_plugin.optim import CayleyAdam
from fora_plugin.stiefel import orthogonality_error
from fora_plugin.zero import (
    ZeroFoRAOptimizer,
    build_zero_fora_optimizer,
    check_deepspeed_config,
    join_deepspeed_process_group,
    load_deepspeed_config,
)


sys.path.insert(0, str(Path(__file__).parent / "distributed"))
import zero3_engine  # noqa: E402
import zero_buckets  # noqa: E402
import zero_engine  # noqa: E402
import zero_precision  # noqa: E402


HERE = Path(__file__).parent


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def torchrun(script: Path | str, *args: str, nproc: int = 2, timeout: int = 1200) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc`` of a script of tests/distributed (a Path) or of a module (a str, run as
    ``-m module``) on CPU processes over gloo, DeepSpeed on its CPU accelerator. The first DeepSpeed run JIT-builds
    its shared-memory op (minutes); later runs reuse ~/.cache/torch_extensions."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    target = ["-m", script] if isinstance(script, str) else [str(script)]
    for _ in range(2):  # at most one rerun, below
        result = subprocess.run(
            [*command, "--master_port", free_port(), *target, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=HERE.parent,
        )
        # A gloo process can abort at interpreter exit, after destroy_process_group, with a C++ thread still
        # joinable: once in a full suite on this 2-core machine (tests/distributed/fsdp_engine.py), never in 4
        # runs of its test alone. That one signature is run once more; anything else fails.
        if result.returncode == 0 or "terminate called without an active exception" not in result.stderr:
            break
    if result.returncode != 0:
        output = result.stdout[-4000:] + result.stderr[-8000:]
        pytest.fail(f"torchrun {' '.join(target)} failed (rc={result.returncode}):\n{output}")
    return result


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("zero")
    torchrun(HERE / "distributed" / "zero_engine.py", str(out))
    return {
        variant: [torch.load(out / f"{variant}-rank{rank}.pt") for rank in range(zero_engine.WORLD)]
        for variant in zero_engine.VARIANTS
    }


@pytest.fixture(scope="module")
def single_process():
    return zero_engine.train_single_process()


def one_ulp_from(build: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    """``build``, then every lora_A entry moved by one float32 ulp, up or down at random."""

    def perturbed() -> torch.nn.Module:
        model = build()
        signs = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.mul_(1 + torch.finfo(torch.float32).eps * torch.randn(p.shape, generator=signs).sign())
        return model

    return perturbed


def noise_tolerance(reference: dict[str, torch.Tensor], **kwargs) -> float:
    """5x the float noise of a single-process run (``zero_engine.train_single_process(**kwargs)``) itself, the larger
    of two measures of it: the same run with its micro-batch gradients summed in another order (all-reduce and ZeRO's
    buckets change the order, and Adam's normalisation magnifies the rounding of near-zero gradient entries), and the
    same run started from lora_A one ulp away (the engines' matmuls round differently from the single process's, by
    how much depends on the CPU's BLAS kernels: reordered sums alone understated it on a CPU without AVX-512)."""
    original = zero_engine.micro_batch
    try:
        zero_engine.micro_batch = lambda b, r, m: original(b, zero_engine.WORLD - 1 - r, zero_engine.GAS - 1 - m)
        reordered, _ = zero_engine.train_single_process(**kwargs)
    finally:
        zero_engine.micro_batch = original
    build = kwargs.pop("build", None) or zero_engine.build_model
    perturbed, _ = zero_engine.train_single_process(build=one_ulp_from(build), **kwargs)
    noise = max((reference[k] - other[k]).abs().max().item() for other in (reordered, perturbed) for k in reference)
    return 5 * max(noise, 1e-6)


@pytest.fixture(scope="module")
def tolerance(single_process):
    return noise_tolerance(single_process[0])


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(zero_engine.VARIANTS))
def test_replicas_are_identical_and_lora_b_orthonormal(engine_runs, variant):
    rank0, rank1 = engine_runs[variant]
    for name in rank0["lora"]:
        assert torch.equal(rank0["lora"][name], rank1["lora"][name]), name
    for m0, m1 in zip(rank0["masters"], rank1["masters"]):
        assert torch.equal(m0, m1)
        assert orthogonality_error(m0) < 1e-4
    assert rank0["dtype"] == ("torch.bfloat16" if variant.endswith("bf16") else "torch.float32")


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(zero_engine.VARIANTS))
def test_loss_falls(engine_runs, variant):
    losses = engine_runs[variant][0]["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.02, losses


@pytest.mark.slow
def test_lora_b_stays_out_of_the_zero_partition(engine_runs):
    run = engine_runs["zero2"][0]
    lora_a = sum(t.numel() for name, t in run["lora"].items() if "lora_A" in name)
    lora_b = sum(t.numel() for name, t in run["lora"].items() if "lora_B" in name)
    assert run["partitioned"] == lora_a and run["stiefel_numel"] == lora_b


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["zero1", "zero2", "zero2_offload"])
def test_matches_single_process_run_of_the_same_global_batches(engine_runs, single_process, tolerance, variant):
    reference, reference_losses = single_process
    run = engine_runs[variant][0]
    assert run["losses"] == pytest.approx(reference_losses, rel=1e-5)
    # Every step was clipped (one norm over lora_A and lora_B), so the match covers the clipping as well.
    assert min(run["grad_norms"]) > zero_engine.MAX_GRAD_NORM
    for name, tensor in reference.items():
        assert (run["lora"][name] - tensor).abs().max().item() < tolerance, name


@pytest.mark.slow
def test_tolerance_separates_a_wrong_clipping(single_process, tolerance, monkeypatch):
    # Clipping lora_A and lora_B by separate norms (what DeepSpeed's own clipping would give) lands far outside.
    reference, _ = single_process
    clip = torch.nn.utils.clip_grad_norm_

    def clip_separately(params, max_norm):
        params = list(params)
        clip([p for p in params if p.requires_grad and p.ndim == 2 and p.shape[0] < p.shape[1]], max_norm)
        return clip([p for p in params if p.requires_grad and p.ndim == 2 and p.shape[0] >= p.shape[1]], max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_separately)
    wrong, _ = zero_engine.train_single_process()
    assert max((reference[k] - wrong[k]).abs().max().item() for k in reference) > 10 * tolerance


# ------------------------------------------------------------------------------------------------------ ZeRO-3
@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("zero3")
    torchrun(HERE / "distributed" / "zero3_engine.py", str(out))
    runs = ("scores", *zero3_engine.VARIANTS)
    return {run: [torch.load(out / f"{run}-rank{rank}.pt") for rank in range(zero_engine.WORLD)] for run in runs}


@pytest.fixture(scope="module")
def zero3_reference():
    """The single-process run of the same global batches, skipping the step whose gradients were NaN, and the
    tolerance its own float noise gives."""
    run = dict(build=zero3_engine.build_model, skip_steps={zero3_engine.NAN_STEP})
    reference, losses = zero_engine.train_single_process(**run)
    return reference, losses, noise_tolerance(reference, **run)


@pytest.mark.slow
def test_zero3_matches_single_process_run_of_the_same_global_batches(zero3_runs, zero3_reference):
    reference, reference_losses, tolerance = zero3_reference
    run = zero3_runs["zero3"][0]
    kept = [i for i in range(zero_engine.STEPS) if i != zero3_engine.NAN_STEP]
    assert [run["losses"][i] for i in kept] == pytest.approx([reference_losses[i] for i in kept], rel=1e-5)
    # Nearly every step was clipped by DeepSpeed's one norm over lora_A and lora_B: the match covers the clipping.
    clipped = [i for i in kept if run["grad_norms"][i] > zero_engine.MAX_GRAD_NORM]
    assert len(clipped) >= len(kept) - 2, run["grad_norms"]
    assert set(reference) == set(run["lora"])
    for name, tensor in reference.items():
        assert (run["lora"][name] - tensor).abs().max().item() < tolerance, name


@pytest.mark.slow
def test_zero3_tolerance_separates_a_step_not_skipped(zero3_runs, zero3_reference):
    # Had the NaN step been applied anywhere (or its batch kept), the result would land far outside the tolerance.
    reference, _, tolerance = zero3_reference
    not_skipped, _ = zero_engine.train_single_process(zero3_engine.build_model)
    assert max((reference[k] - not_skipped[k]).abs().max().item() for k in reference) > 10 * tolerance


@pytest.mark.slow
@pytest.mark.parametrize("variant", zero3_engine.VARIANTS)
def test_zero3_nan_step_is_skipped_on_every_rank(zero3_runs, variant):
    rank0, rank1 = zero3_runs[variant]
    expected = [i != zero3_engine.NAN_STEP for i in range(zero_engine.STEPS)]
    assert rank0["applied"] == rank1["applied"] == expected
    assert rank0["client_steps"] == rank1["client_steps"] == zero_engine.STEPS - 1
    assert math.isnan(rank0["losses"][zero3_engine.NAN_STEP])
    # The logged norm of the skipped step says so (not the last applied step's).
    assert rank0["grad_norms"][zero3_engine.NAN_STEP] == math.inf


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["zero3", "zero3_bf16"])
def test_zero3_lora_b_orthonormal_and_ranks_agree(zero3_runs, variant):
    rank0, rank1 = zero3_runs[variant]
    assert rank0["module_dtype"] == ("torch.bfloat16" if variant.endswith("bf16") else "torch.float32")
    # The up_proj lora_B is split unevenly and off row boundaries: 135 elements, 68 per rank (one of them padding).
    assert rank0["uneven"] == {"numel": 135, "partition": 68, "shape": (45, 3)}
    lora_b = {name: b for name, b in rank0["lora"].items() if "lora_B" in name}
    assert any(zero3_engine.UNEVEN in name for name in lora_b)
    assert max(orthogonality_error(b).item() for b in lora_b.values()) < 1e-5
    # Each rank stepped whole copies of every lora_B: the same values, moments included.
    for key in ("full_b", "exp_avg"):
        assert all(torch.equal(a, b) for a, b in zip(rank0[key], rank1[key])), key
    # ... and wrote them into DeepSpeed's fp32 partitions, which is what the module and checkpoints get.
    assert all(torch.equal(full, b) for full, b in zip(rank0["full_b"], lora_b.values(), strict=True))


@pytest.fixture(scope="module")
def zero3_moe_reference():
    run = dict(build=zero3_engine.build_moe_model, skip_steps={zero3_engine.NAN_STEP}, **zero3_engine.MOE_OPTIMIZER)
    reference, losses = zero_engine.train_single_process(**run)
    return reference, losses, noise_tolerance(reference, **run)


@pytest.mark.slow
def test_zero3_moe_steps_each_expert_block_on_its_own_manifold(zero3_runs):
    # Seen before: ZeRO-3 built its Cayley groups without num_experts, so a fused-MoE lora_B (d_out, r·E) was one
    # Stiefel matrix (the experts forced orthogonal to each other), or, with r·E > d_out as here, not built at all.
    rank0, rank1 = zero3_runs["zero3_moe"]
    assert rank0["num_experts"] == [1, zero3_engine.MOE_EXPERTS]
    experts = {name: b for name, b in rank0["lora"].items() if "experts" in name and "lora_B" in name}
    assert len(experts) == 2 * len(zero3_engine.MOE_LAYERS)
    for name, b in experts.items():
        assert b.shape[1] == zero3_engine.MOE_RANK * zero3_engine.MOE_EXPERTS > b.shape[0], name  # r·E > d_out
        blocks = expert_blocks(b, zero3_engine.MOE_EXPERTS)  # (E, d_out, r)
        assert orthogonality_error(blocks).max() < 1e-5, name
        assert (blocks[0].T @ blocks[1]).abs().max() > 1e-2, name  # each expert its own manifold, not one
    dense = [b for name, b in rank0["lora"].items() if "lora_B" in name and name not in experts]
    assert max(orthogonality_error(b).item() for b in dense) < 1e-5
    for key in ("full_b", "exp_avg"):
        assert all(torch.equal(a, b) for a, b in zip(rank0[key], rank1[key])), key


@pytest.mark.slow
def test_zero3_moe_matches_single_process_run(zero3_runs, zero3_moe_reference):
    reference, reference_losses, tolerance = zero3_moe_reference
    run = zero3_runs["zero3_moe"][0]
    kept = [i for i in range(zero_engine.STEPS) if i != zero3_engine.NAN_STEP]
    assert [run["losses"][i] for i in kept] == pytest.approx([reference_losses[i] for i in kept], rel=1e-5)
    assert set(reference) == set(run["lora"])
    for name, tensor in reference.items():
        assert (run["lora"][name] - tensor).abs().max().item() < tolerance, name


@pytest.mark.slow
def test_zero3_counts_one_cayley_step_per_optimizer_step(zero3_runs):
    # DeepSpeed calls the client once per sub-group: with a dense and an expert Stiefel group, each Cayley group was
    # stepped at both calls, so its periodic QR came at half its period.
    run = zero3_runs["zero3_moe"][0]
    applied = zero_engine.STEPS - 1  # the NaN step is skipped by DeepSpeed
    assert run["client_steps"] == applied
    assert run["cayley_steps"] == [applied, applied]
    assert run["qr_period"] == [zero_engine.optimizer_kwargs()["qr_period"]] * 2


@pytest.mark.slow
def test_zero3_client_step_makes_no_host_sync(zero3_runs):
    # Every call DeepSpeed made (one per sub-group and step: the first step, the QR step, the others) reads nothing
    # back to the host; the NaN step DeepSpeed skips never reaches the client.
    for rank in zero3_runs["zero3_moe"]:
        syncs = rank["host_syncs"]
        assert len(syncs) >= 3 * (zero_engine.STEPS - 1) and set(syncs) == {0}, syncs


@pytest.mark.slow
def test_zero3_fisher_scores_equal_single_process_and_form_no_weight_gradient(zero3_runs):
    rank0, rank1 = zero3_runs["scores"]
    assert rank0["partitioned"]  # the base weights were zero.Init partitions while scored
    assert rank0["scores"] == rank1["scores"]  # one all-reduce: the same selection on every rank
    assert rank0["num_batches"] == zero3_engine.SCORE_BATCHES
    assert rank0["scores"] == pytest.approx(zero3_engine.score_single_process(), rel=1e-5)
    assert rank0["weights_requiring_grad"] == [] and rank0["grads_left"] == []


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("zero_trainer")
    torchrun(HERE / "distributed" / "zero_trainer.py", str(out))
    runs = {
        run: [torch.load(out / f"{run}-rank{rank}.pt") for rank in range(2)] for run in ("full", "resumed", "qfora")
    }
    return out, runs


@pytest.mark.slow
def test_fora_sft_trainer_under_hf_deepspeed_integration(trainer_runs):
    out, runs = trainer_runs
    rank0, rank1 = runs["full"]
    assert rank0["client"] == "ZeroFoRAOptimizer"
    # DeepSpeed's clipping is off; FoRA's optimizer clips lora_A and lora_B by one norm at max_grad_norm.
    assert rank0["engine_gradient_clipping"] == 0.0 and rank0["client_max_grad_norm"] == 0.5
    assert rank0["client_steps"] == 6
    assert len(rank0["chosen"]) == 2
    for name in rank0["lora"]:
        assert torch.equal(rank0["lora"][name], rank1["lora"][name]), name
    assert {n.split(".layers.")[1].split(".")[0] for n in rank0["lora"]} == {str(i) for i in rank0["chosen"]}
    assert max(orthogonality_error(m).item() for m in rank0["masters"]) < 1e-4
    assert rank0["losses"][-1] < rank0["losses"][0]
    assert (out / "full" / "out" / "checkpoint-3" / "fora_stiefel_optimizer.pt").is_file()
    # The logged grad_norm is the one FoRA clipped by (lora_A and lora_B), not DeepSpeed's lora_A-only norm.
    assert rank0["logs"][-1]["grad_norm"] == pytest.approx(rank0["client_last_grad_norm"])
    assert all(log["fora/max_orthogonality_error"] < 1e-4 for log in rank0["logs"])


@pytest.mark.slow
def test_resume_under_deepspeed_restores_the_cayley_state(trainer_runs):
    _, runs = trainer_runs
    full, resumed = runs["full"][0], runs["resumed"][0]
    assert resumed["client_steps"] == full["client_steps"]
    assert resumed["losses"] == pytest.approx(full["losses"], rel=1e-6)
    for name, tensor in full["lora"].items():
        torch.testing.assert_close(resumed["lora"][name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_qfora_under_deepspeed_zero2(trainer_runs):
    # A 4-bit NF4 base (bitsandbytes on the CPU) under ZeRO-2: scored through the Linear4bit inputs and output
    # gradients, LoRA on the chosen layers, Stiefel lora_B beside the partition.
    _, runs = trainer_runs
    rank0, rank1 = runs["qfora"]
    assert rank0["client"] == "ZeroFoRAOptimizer" and rank0["linear4bit"] == 4 * 7
    for name in rank0["lora"]:
        assert torch.equal(rank0["lora"][name], rank1["lora"][name]), name
    assert {n.split(".layers.")[1].split(".")[0] for n in rank0["lora"]} == {str(i) for i in rank0["chosen"]}
    assert max(orthogonality_error(m).item() for m in rank0["masters"]) < 1e-4
    assert rank0["losses"][-1] < rank0["losses"][0]


# ------------------------------------------------------------------------------------------ one-process checks
def small_model():
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, layers_to_transform=[1], lora_dropout=0.0)
    model = get_peft_model(tiny_llama(num_layers=2), config)
    make_stiefel(model, generator=torch.Generator().manual_seed(0))
    return model


def test_zero_optimizer_keeps_stiefel_groups_out_of_param_groups():
    model = small_model()
    optimizer = build_zero_fora_optimizer(model, lr=1e-3, lr_stiefel=1e-2, max_grad_norm=1.0)
    in_groups = {id(p) for g in optimizer.param_groups for p in g["params"]}
    stiefel = {id(p) for p in optimizer.stiefel_parameters}
    lora_b = {id(p) for n, p in model.named_parameters() if "lora_B" in n}
    assert stiefel == lora_b and not in_groups & stiefel
    assert in_groups | stiefel == {id(p) for p in model.parameters() if p.requires_grad}


def test_deepspeed_clients_step_eagerly_unless_the_capture_is_asked_for(monkeypatch):
    """Unset, cuda_graph captures where a group can be; under DeepSpeed it stays eager (not measured there), and True
    still reaches Cayley-Adam (here on a stand-in graph backend for the CPU)."""
    from fora_plugin.optim import cayley_adam
    from fora_plugin.zero.stage3 import build_zero3_fora_optimizer

    monkeypatch.setitem(cayley_adam.GRAPH_BACKENDS, "cpu", lambda run, device: run)
    for build in (build_zero_fora_optimizer, build_zero3_fora_optimizer):
        for asked, captured in ((None, False), (False, False), (True, True)):
            optimizer = build(small_model(), lr=1e-3, lr_stiefel=1e-2, cuda_graph=asked)
            groups = optimizer.stiefel.param_groups
            assert [cayley_adam.resolve_cuda_graph(g["cuda_graph"], g["params"]) for g in groups] == [captured], (
                build.__name__,
                asked,
            )


def test_zero_optimizer_refuses_a_stiefel_group_and_bad_settings():
    model = small_model()
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    a = [p for n, p in model.named_parameters() if "lora_A" in n]
    with pytest.raises(ValueError, match="stiefel=True in params"):
        ZeroFoRAOptimizer([{"params": b, "stiefel": True}], CayleyAdam(b))
    with pytest.raises(ValueError, match="max_grad_norm=-1"):
        ZeroFoRAOptimizer([{"params": a}], CayleyAdam(b), max_grad_norm=-1)
    with pytest.raises(ValueError, match="sync_period=1.5"):
        ZeroFoRAOptimizer([{"params": a}], CayleyAdam(b), sync_period=1.5)
    with pytest.raises(TypeError, match="has no _global_grad_norm / clip_grad"):
        ZeroFoRAOptimizer([{"params": a}], CayleyAdam(b), max_grad_norm=1.0).bind(object())


def test_step_without_bind_names_the_fix():
    model = small_model()
    optimizer = build_zero_fora_optimizer(model, max_grad_norm=1.0)
    ids = torch.arange(8)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(ValueError, match=r"call bind\(engine.optimizer\)"):
        optimizer.step()


def test_one_process_step_equals_fora_optimizer_with_global_clipping():
    # Without DeepSpeed (world size 1) the ZeRO client is exactly FoRAOptimizer + clip_grad_norm_ over everything.
    from fora_plugin import build_fora_optimizer

    class NormSource:  # what DeepSpeed's ZeRO optimizer exposes: the norm of the partitioned (lora_A) gradients
        _global_grad_norm = None
        clip_grad = 0.05

    ids = torch.arange(10)[None] % 7
    models = [small_model(), small_model()]
    reference = build_fora_optimizer(models[0], lr=1e-2, lr_stiefel=5e-2)
    zero = build_zero_fora_optimizer(models[1], lr=1e-2, lr_stiefel=5e-2, max_grad_norm=0.05)
    source = NormSource()
    zero.bind(source)
    for _ in range(3):
        for model in models:
            model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(models[0].parameters(), 0.05)
        reference.step()
        reference.zero_grad()
        lora_a = [p.grad for g in zero.param_groups for p in g["params"]]
        source._global_grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in lora_a]))
        zero.step()
        zero.zero_grad()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert source.clip_grad == 0.0  # DeepSpeed's own clipping (lora_A by its own norm) is off once bound


class NormSource:
    """What DeepSpeed's ZeRO-1/2 optimizer exposes to the client: the norm of the partitioned (lora_A) gradients,
    a tensor on the device, and its own clipping, which bind() turns off."""

    clip_grad = 0.05

    def __init__(self):
        self._global_grad_norm = None

    def update(self, client: ZeroFoRAOptimizer) -> None:
        grads = [p.grad for g in client.param_groups for p in g["params"]]
        self._global_grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


def counted_zero_step(model, optimizer, source, before_step=lambda: None):
    from host_sync import HostSyncCounter

    ids = torch.arange(10)[None] % 7
    model(input_ids=ids, labels=ids).loss.backward()
    source.update(optimizer)
    before_step()
    with HostSyncCounter() as syncs:
        optimizer.step()
    optimizer.zero_grad()
    return syncs


def test_zero_client_step_makes_no_host_sync():
    # Seen before: 7 per step (float() of the norms, .tolist() of the has-gradient counts). On a GPU each one stalls
    # the launch queue. AdamW is fused: the non-fused one reads its step counts, CPU tensors even on a GPU.
    model = small_model()
    optimizer = build_zero_fora_optimizer(model, lr=1e-2, lr_stiefel=5e-2, max_grad_norm=0.05, qr_period=2, fused=True)
    source = NormSource()
    optimizer.bind(source)
    first, b = optimizer.stiefel_parameters[:2]
    for step in range(3):  # the first step (state made), a periodic QR step, an ordinary one
        syncs = counted_zero_step(model, optimizer, source)
        assert syncs.count == 0, f"step {step}: {syncs.report()}"
    # The skip path: a non-finite lora_B gradient (DeepSpeed, which never sees lora_B, steps lora_A as usual).
    before = first.detach().clone()
    syncs = counted_zero_step(model, optimizer, source, lambda: first.grad.view(-1)[0].fill_(float("nan")))
    assert syncs.count == 0, syncs.report()
    assert torch.equal(first, before) and optimizer.stiefel.skipped_steps() == 1
    # The re-projection path: a lora_B that has drifted from the manifold.
    with torch.no_grad():
        b.mul_(1.01)
    syncs = counted_zero_step(model, optimizer, source)
    assert syncs.count == 0, syncs.report()
    assert optimizer.stiefel.reprojections() == 1 and orthogonality_error(b) < 1e-5
    assert optimizer.last_grad_norm > 0.05  # read once, for a log: every step here was clipped


def test_a_log_reads_the_zero_clients_gradient_norm_once():
    # Seen before: twice (a host sync each), so a log under DeepSpeed made three host reads where one is the aim; then
    # the norm in a read of its own beside the log's values (and the monitor's counters in a third).
    from host_sync import HostSyncCounter

    from fora_plugin.selection import FoRASelection
    from fora_plugin.wiring import FoRALogs

    model = small_model()
    optimizer = build_zero_fora_optimizer(model, lr=1e-2, lr_stiefel=5e-2, max_grad_norm=0.05, fused=True)
    source = NormSource()
    optimizer.bind(source)
    counted_zero_step(model, optimizer, source)
    expected = optimizer.last_grad_norm
    with HostSyncCounter() as syncs:
        logs = FoRALogs(FoRASelection([0, 1], 2, "model.layers"))(model, optimizer)
    assert syncs.count == 1, syncs.report()  # the drift, ΔW's ranks, the counters and the gradient norm in one read
    assert logs["grad_norm"] == pytest.approx(expected) and expected > 0.05
    assert logs["fora/skipped_steps"] == optimizer.stiefel.skipped_steps() == 0


def test_a_lora_b_without_gradient_on_any_rank_is_left_alone():
    # As CayleyAdam with p.grad None (and DDP's unused parameters): no momentum-only step, no step count.
    model = small_model()
    optimizer = build_zero_fora_optimizer(model)
    ids = torch.arange(8)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    unused, *others = optimizer.stiefel_parameters
    unused.grad = None
    before = [p.detach().clone() for p in optimizer.stiefel_parameters]
    optimizer.step()
    assert torch.equal(unused, before[0]) and not optimizer.stiefel.state[unused]
    assert all(not torch.equal(p, b) for p, b in zip(others, before[1:]))


def test_resumed_bf16_state_keeps_its_dtypes():
    model = small_model()
    for _, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    optimizer = build_zero_fora_optimizer(model.to(torch.bfloat16))
    ids = torch.arange(8)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    saved = optimizer.stiefel_state_dict()
    optimizer.load_stiefel_state_dict(saved)
    state = optimizer.stiefel.state[optimizer.stiefel_parameters[0]]
    assert state["step"].dtype == torch.float32 and state["skipped_steps"].dtype == torch.int64
    assert state["master"].dtype == torch.float32 and state["exp_avg"].dtype == torch.float32


def test_lora_b_still_steps_after_load_state_dict():
    # DeepSpeed's resume calls the client's load_state_dict, which replaces the group dicts.
    model = small_model()
    optimizer = build_zero_fora_optimizer(model)
    optimizer.load_state_dict(optimizer.state_dict())
    before = [p.detach().clone() for p in optimizer.stiefel_parameters]
    ids = torch.arange(8)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert optimizer.steps == 1
    assert all(not torch.equal(b, p) for b, p in zip(before, optimizer.stiefel_parameters))


def test_a_resumed_stiefel_state_keeps_this_runs_eager_step(monkeypatch):
    """A Cayley state saved with cuda_graph unset (None, which captures outside DeepSpeed) does not make the client's
    step captured on resume: how the step runs is this run's choice."""
    from fora_plugin.optim import cayley_adam

    monkeypatch.setitem(cayley_adam.GRAPH_BACKENDS, "cpu", lambda run, device: run)
    optimizer = build_zero_fora_optimizer(small_model())
    saved = optimizer.stiefel_state_dict()
    (saved_group,) = saved["stiefel"]["param_groups"]
    saved_group["cuda_graph"] = None
    optimizer.load_stiefel_state_dict(saved)
    (group,) = optimizer.stiefel.param_groups
    assert group["cuda_graph"] is False
    assert not cayley_adam.resolve_cuda_graph(group["cuda_graph"], group["params"])


def test_stiefel_state_round_trip_restores_the_master():
    model = small_model()
    optimizer = build_zero_fora_optimizer(model)
    ids = torch.arange(8)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    saved = optimizer.stiefel_state_dict()
    other = build_zero_fora_optimizer(small_model())
    other.load_stiefel_state_dict(saved)
    assert other.steps == 1
    for p, q in zip(optimizer.stiefel_parameters, other.stiefel_parameters):
        torch.testing.assert_close(optimizer.stiefel.state[p]["exp_avg"], other.stiefel.state[q]["exp_avg"])


# --------------------------------------------------------------------------------------------------- refusals
STIEFEL = FoRAConfig(mode="fora")


@pytest.mark.parametrize(
    ("ds", "match"),
    [
        ({"zero_optimization": {"stage": 0}}, "stage=0"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}, "`optimizer` block \\('AdamW'\\)"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
            "offloads the optimizer to 'cpu' with zero_force_ds_cpu_optimizer true",
        ),
        ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, "fp16.enabled=True"),
        # DeepSpeed's engine picks BF16_Optimizer over ZeRO-1's here (its _do_optimizer_sanity_check).
        (
            {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
            r"stage=1 with bf16.enabled=true and data_types.grad_accum_dtype='fp32': .*BF16_Optimizer",
        ),
        (
            {
                "zero_optimization": {"stage": 1},
                "bfloat16": {"enabled": True},
                "data_types": {"grad_accum_dtype": "float"},
            },
            r"stage=1 with bfloat16.enabled=true and data_types.grad_accum_dtype='float': .*Use stage 2",
        ),
    ],
)
def test_refused_deepspeed_settings(ds, match):
    with pytest.raises(ValueError, match=match):
        check_deepspeed_config(ds, STIEFEL)


@pytest.mark.parametrize(
    ("zero", "match"),
    [
        ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer.device='cpu' under ZeRO-3"),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "offload_param.device='nvme' under ZeRO-3"),
    ],
)
def test_refused_zero3_settings(zero, match):
    with pytest.raises(ValueError, match=match):
        check_deepspeed_config({"zero_optimization": zero, "zero_force_ds_cpu_optimizer": False}, STIEFEL)


def test_accepted_deepspeed_settings():
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    check_deepspeed_config({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, STIEFEL)
    check_deepspeed_config({"zero_optimization": offload, "zero_force_ds_cpu_optimizer": False}, STIEFEL)
    # fg-lora has no Stiefel lora_B: DeepSpeed's own optimizer is AdamW as FoRA's would be.
    with_optimizer = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}
    check_deepspeed_config(with_optimizer, FoRAConfig(mode="fg-lora"))
    for fora in (STIEFEL, FoRAConfig(mode="fg-lora")):
        check_deepspeed_config({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, fora)
    check_deepspeed_config({"zero_optimization": {"stage": 3}}, FoRAConfig(mode="lora"))
    # ZeRO-1 keeps its own optimizer with bf16 accumulation, with fp32 weights, or with optimizer offload.
    fp32_accum = {"data_types": {"grad_accum_dtype": "fp32"}}
    check_deepspeed_config({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}, STIEFEL)
    check_deepspeed_config({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, **fp32_accum}, STIEFEL)
    check_deepspeed_config({"zero_optimization": {"stage": 1}, "bf16": {"enabled": False}, **fp32_accum}, STIEFEL)
    offload = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    ds = {"zero_optimization": offload, "zero_force_ds_cpu_optimizer": False, "bf16": {"enabled": True}, **fp32_accum}
    check_deepspeed_config(ds, STIEFEL)
    check_deepspeed_config(
        {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, **fp32_accum}, FoRAConfig(mode="fg-lora")
    )


def test_example_deepspeed_configs_are_accepted():
    folder = HERE.parent / "example_configs" / "deepspeed"
    for name in ("zero2.json", "zero2_offload.json", "zero2_qfora.json"):
        check_deepspeed_config(load_deepspeed_config(folder / name), STIEFEL)
    check_deepspeed_config(load_deepspeed_config(folder / "zero3.json"), STIEFEL)
    with pytest.raises(ValueError, match="is not a file"):
        load_deepspeed_config(folder / "absent.json")


def test_malformed_deepspeed_settings_name_the_value():
    with pytest.raises(ValueError, match="zero_optimization.stage='auto'"):
        check_deepspeed_config({"zero_optimization": {"stage": "auto"}}, STIEFEL)
    with pytest.raises(ValueError, match="`optimizer` block \\(None\\)"):
        check_deepspeed_config({"zero_optimization": {"stage": 2}, "optimizer": None}, STIEFEL)


# ---------------------------------------------------------------------------------------- ZeRO-3, one process
def test_zero3_optimizer_holds_every_group_and_whole_fp32_lora_b():
    from fora_plugin.zero import build_zero3_fora_optimizer

    model = small_model()
    optimizer = build_zero3_fora_optimizer(model, lr=1e-3, lr_stiefel=1e-2, max_grad_norm=1.0)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    stiefel = [g for g in optimizer.param_groups if g.get("stiefel")]
    # lora_B stays in DeepSpeed's groups (its own reduce-scatter and the one clipping norm), at lr_stiefel.
    assert len(stiefel) == 1 and stiefel[0]["lr"] == 1e-2
    assert [id(p) for p in stiefel[0]["params"]] == [id(p) for p in lora_b]
    for full, b in zip(optimizer.stiefel_parameters, lora_b, strict=True):
        assert torch.equal(full, b) and full.dtype == torch.float32 and full is not b


@pytest.mark.parametrize("rank", [4, 12])  # r·E = 16 <= d_out = 32, and 48 > 32
def test_zero3_optimizer_keeps_every_cayley_setting_of_the_single_process_one(rank):
    # Seen before: the ZeRO-3 Cayley groups were built from a copied key list without num_experts and
    # reproject_threshold: a fused-MoE lora_B was one Stiefel matrix (and with r·E > d_out no optimizer at all).
    from test_moe import fora_moe, moe_lora_config

    from fora_plugin import build_fora_optimizer
    from fora_plugin.zero import build_zero3_fora_optimizer

    config = moe_lora_config()
    config.r, config.lora_alpha = rank, 2 * rank
    model, _ = fora_moe(config)
    settings = dict(lr_stiefel=1e-2, qr_period=7, reproject_threshold=3e-4, cayley_solver="fixed_point")
    zero3 = build_zero3_fora_optimizer(model, max_grad_norm=1.0, **settings).stiefel.param_groups
    single = [g for g in build_fora_optimizer(model, **settings).param_groups if g["stiefel"]]
    assert [g["num_experts"] for g in zero3] == [1, 4]
    # cuda_graph apart: unset, the single-process step captures where it can, DeepSpeed's clients step eagerly.
    keys = set(inspect.signature(CayleyAdam).parameters) - {"params", "cuda_graph"}
    assert [{k: g[k] for k in keys} for g in zero3] == [{k: g[k] for k in keys} for g in single]
    assert [g["cuda_graph"] for g in zero3] == [False, False] and [g["cuda_graph"] for g in single] == [None, None]


def test_zero3_optimizer_refusals_name_the_fix():
    from fora_plugin.zero import build_zero3_fora_optimizer

    model = small_model()
    optimizer = build_zero3_fora_optimizer(model, max_grad_norm=1.0)
    ids = torch.arange(8)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(TypeError, match="not a DeepSpeed ZeRO-3 partition"):
        optimizer.step()
    with pytest.raises(TypeError, match="has no fp16_groups"):
        optimizer.bind(object())

    class Stage3:  # the attributes bind() reads from DeepSpeed's ZeRO-3 optimizer
        fp32_partitioned_groups_flat = sub_group_process_groups = ()
        fp16_groups = [optimizer.param_groups[-1]["params"][:1], optimizer.param_groups[-1]["params"][1:]]
        clip_grad = 1.0

    with pytest.raises(ValueError, match="sub_group_size splits FoRA's Stiefel group"):
        optimizer.bind(Stage3())
    Stage3.clip_grad = 0.5
    with pytest.raises(ValueError, match=r"gradient_clipping=0.5 differs from FoRA's max_grad_norm=1.0"):
        optimizer.bind(Stage3())


@pytest.fixture(scope="module")
def zero3_trainer_runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("zero3_trainer")
    torchrun(HERE / "distributed" / "zero3_trainer.py", str(out))
    return out, {run: [torch.load(out / f"{run}-rank{rank}.pt") for rank in range(2)] for run in ("full", "resumed")}


@pytest.mark.slow
def test_fora_sft_trainer_under_zero3(zero3_trainer_runs):
    out, runs = zero3_trainer_runs
    rank0, rank1 = runs["full"]
    assert rank0["partitioned_at_load"]  # from_pretrained under the ZeRO-3 config: zero.Init partitioned the base
    assert rank0["client"] == "Zero3FoRAOptimizer" and rank0["client_steps"] == 6
    # DeepSpeed's clipping stays on under ZeRO-3: its one norm covers lora_A and lora_B.
    assert rank0["engine_gradient_clipping"] == 0.5
    assert rank0["scores"] == rank1["scores"] and rank0["chosen"] == rank1["chosen"] and len(rank0["chosen"]) == 2
    assert {n.split(".layers.")[1].split(".")[0] for n in rank0["lora"]} == {str(i) for i in rank0["chosen"]}
    assert all(torch.equal(a, b) for a, b in zip(rank0["full_b"], rank1["full_b"], strict=True))
    lora_b = [t for n, t in rank0["lora"].items() if "lora_B" in n]
    assert max(orthogonality_error(b).item() for b in lora_b) < 1e-5
    assert all(log["fora/max_orthogonality_error"] < 1e-5 for log in rank0["logs"])
    assert rank0["logs"][-1]["loss"] < rank0["logs"][0]["loss"]
    assert (out / "full" / "out" / "checkpoint-3" / "fora_stiefel_optimizer.pt").is_file()


@pytest.mark.slow
def test_zero3_saved_adapter_is_plain_peft_lora(zero3_trainer_runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, runs = zero3_trainer_runs
    trained = runs["full"][0]["lora"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "model"), out / "full" / "out")
    loaded = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    assert set(loaded) == {n.replace(".default", "") for n in trained}
    for name, tensor in trained.items():
        torch.testing.assert_close(loaded[name.replace(".default", "")], tensor, rtol=0, atol=1e-7, msg=name)


@pytest.mark.slow
def test_zero3_resume_restores_the_cayley_state(zero3_trainer_runs):
    _, runs = zero3_trainer_runs
    full, resumed = runs["full"][0], runs["resumed"][0]
    assert resumed["client_steps"] == full["client_steps"]  # 3 restored from the checkpoint, then 4..6
    assert [log["loss"] for log in resumed["logs"][-3:]] == pytest.approx([log["loss"] for log in full["logs"][-3:]])
    for name, tensor in full["lora"].items():
        torch.testing.assert_close(resumed["lora"][name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", [s.value for s in __import__("transformers").SchedulerType])
def test_every_supported_scheduler_moves_the_zero_clients_stiefel_lr_with_lora_as(name):
    # Under DeepSpeed the schedule acts on the client's AdamW groups only; the Cayley-Adam rate follows their factor.
    from test_optim import SCHEDULER_KWARGS
    from transformers import get_scheduler

    from fora_plugin.optim import UNSUPPORTED_LR_SCHEDULERS

    if name in UNSUPPORTED_LR_SCHEDULERS:
        pytest.skip(f"{name} is refused by name (test_optim)")
    model = get_peft_model(tiny_llama(num_layers=2), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    make_stiefel(model, generator=torch.Generator().manual_seed(0))
    opt = build_zero_fora_optimizer(model, lr=2e-4, lr_stiefel=1e-3)
    assert opt.defaults["lr"] == 2e-4  # polynomial, the min-lr schedules, accelerate read it
    scheduler = get_scheduler(
        name, opt, num_warmup_steps=2, num_training_steps=12, scheduler_specific_kwargs=SCHEDULER_KWARGS.get(name)
    )
    rates = []
    for step in range(12):
        opt.step()  # no gradients: the Stiefel lr is set from the first group's, nothing moves
        rates.append((opt.param_groups[0]["lr"], opt.stiefel.param_groups[0]["lr"]))
        if name == "reduce_lr_on_plateau":
            scheduler.step(float(step))  # a loss that never improves
        else:
            scheduler.step()
    assert all(abs(b - 5 * a) < 1e-12 for a, b in rates), rates
    if name != "constant":
        assert len({a for a, _ in rates}) > 1  # the schedule did act


# ----------------------------------------------------------------------- docs/distributed.md's ZeRO-3 CLI launch
@pytest.fixture(scope="module")
def zero3_cli_run(tmp_path_factory):
    """``torchrun --nproc_per_node 2 -m fora_plugin.cli train example_configs/quickstart.yaml --model_name_or_path
    <tiny Llama> --deepspeed example_configs/deepspeed/zero3.json``, as docs/distributed.md gives it, 2 steps, with
    activation checkpointing on as in the paper's configs (non-reentrant: transformers' default)."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("zero3_cli")
    tiny_llama(4, vocab_size=99).save_pretrained(root / "model")
    char_tokenizer().save_pretrained(root / "model")
    examples = HERE.parent / "example_configs"
    torchrun(
        "fora_plugin.cli",
        "train",
        str(examples / "quickstart.yaml"),
        "--model_name_or_path",
        str(root / "model"),
        "--deepspeed",
        str(examples / "deepspeed" / "zero3.json"),
        "--output_dir",
        str(root / "out"),
        "--max_steps",
        "2",
        "--fora_fisher_batches",
        "2",
        "--activation_checkpointing",
        "true",
    )
    return root


@pytest.mark.slow
def test_the_readme_zero3_cli_launch_trains_and_saves_a_plain_peft_adapter(zero3_cli_run):
    # Seen before: it died in deepspeed.zero.Init inside TRL's from_pretrained ("train_batch_size is not equal to
    # micro_batch_per_gpu * gradient_acc_step * world_size 4 != 2 * 1 * 1"): DeepSpeed's comm layer, not yet set
    # up on CPU ranks, counted 1 rank where HF counted 2. And in the first backward with checkpointing ("Recomputed
    # values for the following tensors have different metadata"): the scoring engine's backward hooks stayed on the
    # modules, so the training engine's recomputed layers found their weights released.
    import json

    from safetensors.torch import load_file

    out = zero3_cli_run / "out"
    selection = json.loads((out / "fora_scores.json").read_text())
    chosen = selection["chosen_layers"]
    assert selection["num_layers"] == 4 and selection["k"] == len(chosen) == 2
    weights = load_file(out / "adapter_model.safetensors")
    assert {int(n.split(".layers.")[1].split(".")[0]) for n in weights} == set(chosen)
    lora_b = {n: w for n, w in weights.items() if "lora_B" in n}
    assert len(lora_b) == len(chosen) * len(TARGETS)
    assert max(orthogonality_error(w.float()).item() for w in lora_b.values()) < 1e-5
    # Plain PEFT LoRA: it loads onto the base model without FoRA, and the trained adapter changes its output.
    base = tiny_llama(4, vocab_size=99)
    model = PeftModel.from_pretrained(tiny_llama(4, vocab_size=99), out)
    ids = torch.arange(12)[None] % 99
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, base(input_ids=ids).logits)


def test_a_deepspeed_launch_hf_does_not_count_is_refused(monkeypatch):
    # On a CPU-only machine without use_cpu, accelerate sees one process while torchrun started two: each rank would
    # train the whole batch on its own.
    from types import SimpleNamespace

    monkeypatch.setenv("WORLD_SIZE", "2")
    args = SimpleNamespace(deepspeed="zero3.json", world_size=1, use_cpu=False)
    with pytest.raises(ValueError, match=r"started WORLD_SIZE=2 processes, but .* world_size=1 .*Set use_cpu true"):
        join_deepspeed_process_group(args)
    join_deepspeed_process_group(SimpleNamespace(deepspeed=None, world_size=1, use_cpu=False))  # no DeepSpeed
    monkeypatch.setenv("WORLD_SIZE", "1")
    join_deepspeed_process_group(args)  # one process: nothing to join


@pytest.fixture(scope="module")
def bucket_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_buckets")
    torchrun(HERE / "distributed" / "zero_buckets.py", str(out), nproc=1)
    return json.loads((out / "buckets.json").read_text())


@pytest.mark.parametrize("variant", list(zero_buckets.VARIANTS))
def test_plan_counts_the_gradient_reduction_buffers_a_real_engine_allocates(bucket_runs, tmp_path, variant):
    """The bytes of DeepSpeed's ipg buffers, read inside a real ZeRO-1/2 engine's backward (gone after it), are what
    `fora plan` adds to the backward for the same DeepSpeed block."""
    import yaml

    from fora_plugin.plan import plan_setup

    zero, bf16 = zero_buckets.VARIANTS[variant]
    run = bucket_runs[variant]
    real = sum(sum(sizes) for sizes in run["during"].values())
    assert real > 0 and all(sizes == [] for sizes in run["after"].values())
    tiny_llama_config().save_pretrained(tmp_path / "model")
    config = tmp_path / "config.yaml"
    keys = {"model_name_or_path": str(tmp_path / "model"), "output_dir": str(tmp_path), "bf16": bf16}
    config.write_text(yaml.safe_dump({**keys, "lora_target_modules": TARGETS, "report_to": "none"}))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": zero, "bf16": {"enabled": "auto"}}))
    buffers = plan_setup(str(config), ["--deepspeed", str(ds)], gpus=2).reduce_buffers
    assert buffers.nbytes == real
    assert str(buffers.dtype) == run["dtype"] == next(iter(run["during"]))


@pytest.fixture(scope="module")
def precision_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_precision")
    torchrun(HERE / "distributed" / "zero_precision.py", str(out), nproc=1)
    return json.loads((out / "precision.json").read_text())


def test_plan_counts_the_lora_weights_and_fp32_partitions_of_a_real_zero2_engine(precision_runs, tmp_path):
    """A real ZeRO-2 engine (one rank) in bf16 makes every LoRA weight bf16 and keeps fp32 partitions (the masters)
    and fp32 moments of what it steps, FoRA's Cayley-Adam an fp32 master and moment of each Stiefel lora_B; in fp32 it
    still steps an fp32 copy of lora_A. `fora plan` plans the same bytes per mode: LoRA weights, AdamW states (but
    one step count per matrix where the engine keeps one per flat group) and the Stiefel part (whose step-count
    bookkeeping is the fake step's)."""
    import dataclasses

    import yaml

    from fora_plugin.plan import measure, plan_setup

    tiny_llama_config().save_pretrained(tmp_path / "model")
    config = tmp_path / "config.yaml"
    keys = {"model_name_or_path": str(tmp_path / "model"), "output_dir": str(tmp_path)}
    lora = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "fora_layers": zero_engine.ADAPTED_LAYERS}
    config.write_text(yaml.safe_dump({**keys, **lora, "lora_target_modules": TARGETS, "report_to": "none"}))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": zero_precision.ZERO, "bf16": {"enabled": "auto"}}))
    for name, (mode, bf16) in zero_precision.VARIANTS.items():
        run = precision_runs[name]
        overrides = ["--deepspeed", str(ds), "--max_length", str(zero_engine.SEQ_LEN), "--bf16", str(bf16).lower()]
        setup = dataclasses.replace(plan_setup(str(config), overrides, gpus=1), loss_head_device="cpu")
        phase = measure.measure(setup, (mode,), zero_engine.ADAPTED_LAYERS, scoring=False)[mode][0]
        step = phase.peak  # the forward's candidate: the states alive, no gradient
        dtype = "torch.bfloat16" if bf16 else "torch.float32"
        assert run["lora_dtypes"] == run["base_dtypes"] == [dtype] == [str(setup.lora_dtype or setup.dtype)], name
        assert run["partition_dtypes"] == ["torch.float32"], name
        assert phase.trainable == run["lora_numel"], name
        assert step["lora_params"] == run["lora_bytes"], name
        # Euclidean matrices: lora_A, and lora_B where AdamW steps them (fg-lora, lora).
        layers = len(zero_engine.ADAPTED_LAYERS) if mode != "lora" else 4
        matrices = layers * len(TARGETS) * (1 if mode == "fora" else 2)
        real = run["fp32_partitions"] + run["base_optimizer"]["tensors"]
        assert step["optimizer_states"] - 4 * matrices == real, name
        if mode == "fora":
            master = 4 * run["stiefel_numel"] if bf16 else 0
            assert run["stiefel"]["tensors"] == master + 4 * run["stiefel_numel"], name  # (master and) exp_avg
            real = run["stiefel"]["tensors"] + run["stiefel"]["scalars"]
            assert 0 <= step["stiefel"] - real < 4 * run["stiefel_numel"] // 2, name  # far below one master's bytes
        else:
            assert "stiefel" not in step and run["stiefel"] is None, name


def test_averaged_gradients_stay_fp32_under_another_default_dtype():
    """The has-gradient counts travel in the gradients' buffer: made in the default dtype, fp64 would promote it."""
    from fora_plugin.zero.stage12 import _averaged_gradients

    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(4, 2))]
    params[0].grad = torch.full((3, 2), 0.5)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        grads = _averaged_gradients(params, None)
    finally:
        torch.set_default_dtype(default)
    assert grads[0].dtype == torch.float32 and torch.equal(grads[0], params[0].grad)
    assert grads[1] is None
