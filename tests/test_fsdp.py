"""FoRA under FSDP2: CPU ranks over gloo against single-process runs of the same global batches, and the checks."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TARGETS, tiny_llama
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from test_trainer import LAYERS, VOCAB
from test_zero import one_ulp_from, torchrun
from transformers.training_args import ParallelMode

from fora_plugin import FoRAConfig, build_fora_optimizer, make_stiefel
from fora_plugin.fsdp import (
    FSDP2Callback,
    check_fsdp,
    check_sharded_training,
    gathered_adapters,
    prepare_fsdp2,
)
from fora_plugin.selection import FoRASelection
from fora_plugin.stiefel import orthogonality_error
from fora_plugin.wiring import FoRALogs


sys.path.insert(0, str(Path(__file__).parent / "distributed"))
import fsdp_engine  # noqa: E402


HERE = Path(__file__).parent
WORLDS = (2, 3)  # 2: uneven row splits (65 -> 33/32); 3: also a rank holding no row of a lora_B (4 -> 2/2/0)


# ------------------------------------------------------------------------------------- fully_shard, driven directly
@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    runs = {}
    for world in WORLDS:
        out = tmp_path_factory.mktemp(f"fsdp{world}")
        torchrun(HERE / "distributed" / "fsdp_engine.py", str(out), nproc=world)
        runs[world] = [{**torch.load(out / f"rank{rank}.pt"), "out": out} for rank in range(world)]
    return runs


@pytest.fixture(scope="module")
def single_process():
    return {world: fsdp_engine.train_single_process(world) for world in WORLDS}


BUILD_MODEL = fsdp_engine.build_model


@pytest.fixture(scope="module")
def tolerance(single_process):
    """5x the float noise of the single-process run itself, the larger of two measures of it: the same run with its
    micro-batch gradients summed in another order (FSDP2's reduce-scatter changes the order, and Adam's
    normalisation magnifies the rounding of near-zero gradient entries), and the same run started from lora_A one
    ulp away (the sharded step's matmuls round differently from the whole ones, by how much depends on the CPU's
    BLAS kernels: on a CPU without AVX-512 the reordered sums alone understated it 9x at 3 ranks)."""
    original = fsdp_engine.micro_batch
    noise = {}
    try:
        fsdp_engine.micro_batch = lambda b, w, r, m: original(b, w, w - 1 - r, fsdp_engine.GAS - 1 - m)
        reordered = {world: fsdp_engine.train_single_process(world)["lora"] for world in WORLDS}
    finally:
        fsdp_engine.micro_batch = original
    try:
        fsdp_engine.build_model = one_ulp_from(BUILD_MODEL)
        perturbed = {world: fsdp_engine.train_single_process(world)["lora"] for world in WORLDS}
    finally:
        fsdp_engine.build_model = BUILD_MODEL
    for world in WORLDS:
        reference = single_process[world]["lora"]
        deviation = max(
            (reference[k] - other[world][k]).abs().max().item() for other in (reordered, perturbed) for k in reference
        )
        noise[world] = 5 * max(deviation, 1e-6)
    return noise


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_sharded_run_matches_single_process_run(engine_runs, single_process, tolerance, world):
    reference = single_process[world]
    run = engine_runs[world][0]["train"]
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for name, tensor in reference["lora"].items():
        assert (run["lora"][name] - tensor).abs().max().item() < tolerance[world], name


@pytest.mark.slow
def test_tolerance_separates_a_step_not_skipped(single_process, tolerance, monkeypatch):
    # A rank that stepped with its own finite rows where the NaN rows of another rank were skipped would have taken
    # the step: the run without the NaN (that step clipped and taken) lands far outside the tolerance.
    monkeypatch.setattr(fsdp_engine, "NAN_STEP", -1)
    stepped = fsdp_engine.train_single_process(2)["lora"]
    reference = single_process[2]["lora"]
    assert max((reference[k] - stepped[k]).abs().max().item() for k in reference) > 10 * tolerance[2]


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_ranks_agree_and_lora_b_stays_orthonormal(engine_runs, world):
    first, *others = engine_runs[world]
    for other in others:
        for name, tensor in first["train"]["lora"].items():
            assert torch.equal(tensor, other["train"]["lora"][name]), name
    drift = max(orthogonality_error(t).item() for n, t in first["train"]["lora"].items() if "lora_B" in n)
    assert drift < 1e-5
    assert first["train"]["exp_avg_type"] == "DTensor"  # the Cayley moment is sharded like lora_B


@pytest.mark.slow
def test_row_splits_are_uneven_and_a_rank_holds_no_row(engine_runs):
    def rows(world, suffix):
        return [run["train"]["local_rows"][f"base_model.model.model.layers.1.{suffix}"] for run in engine_runs[world]]

    assert rows(2, "mlp.up_proj.lora_B.default.weight") == [33, 32]
    assert rows(3, "self_attn.k_proj.lora_B.default.weight") == [2, 2, 0]
    assert rows(3, "mlp.up_proj.lora_B.default.weight") == [22, 22, 21]


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_a_nan_in_one_ranks_rows_skips_that_step_on_every_rank(engine_runs, single_process, world):
    # The NaN sits in rank 0's rows only; the finite check is on the all-reduced ‖G‖², so every rank skips.
    assert [run["train"]["nan_param_skipped"] for run in engine_runs[world]] == [1] * world
    assert (
        [run["train"]["skipped"] for run in engine_runs[world]]
        == [single_process[world]["skipped"]] * world
        == [1] * world
    )


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_resume_from_sharded_state_dicts_continues_the_same_run(engine_runs, world):
    # torch.distributed.checkpoint of the sharded model and optimizer state (the Cayley moments are DTensors).
    for run in engine_runs[world]:
        assert run["resumed"]["losses"] == pytest.approx(run["train"]["losses"], rel=1e-6)
        assert run["resumed"]["skipped"] == run["train"]["skipped"]
        for name, tensor in run["train"]["lora"].items():
            torch.testing.assert_close(run["resumed"]["lora"][name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("fisher_params", ["layer", "targets"])
def test_fisher_scores_on_the_sharded_model_equal_one_process(engine_runs, world, fisher_params):
    # Each rank scores its own batches by x/g (and norms by a local re-run); the reference keeps whole autograd
    # weight gradients of every batch in one process.
    reference = fsdp_engine.fisher_single_process(world, fisher_params)
    for run in engine_runs[world]:
        scores = run["fisher"]["scores"][fisher_params]
        assert not isinstance(scores, str), scores
        assert scores == pytest.approx(reference, rel=1e-5)
        assert run["fisher"]["grads_left"] == []


@pytest.mark.slow
def test_fisher_scores_of_a_sharded_4bit_model_equal_one_process(engine_runs):
    # FSDP-QLoRA: NF4 weights packed in a bf16 storage are sharded by rows like any weight; scored by x/g on each
    # rank's batches, they equal the unsharded 4-bit model's scores (and differ from the float model's).
    runs = engine_runs[2]
    reference = fsdp_engine.fisher_4bit_single_process(runs[0]["out"] / "model", 2)
    for run in runs:
        scores = run["fisher"]["scores_4bit"]
        assert not isinstance(scores, str), scores
        assert scores == pytest.approx(reference, rel=1e-5)
    assert reference != pytest.approx(runs[0]["fisher"]["scores"]["layer"], rel=1e-3)


@pytest.mark.slow
def test_scoring_the_sharded_model_holds_no_base_weight_gradient(engine_runs):
    for run in engine_runs[2]:
        fisher = run["fisher"]
        assert fisher["grads_after_scoring"] == []
        # The keep-all-gradients backward ends holding this rank's rows of every layer weight's gradient (and held a
        # whole layer's before its reduce-scatter); the scoring peak stays below it by at least those rows.
        assert fisher["keep_all_peak"] - fisher["scoring_peak"] >= fisher["local_layer_grad_bytes"], fisher


@pytest.mark.slow
def test_ranks_that_chose_different_layers_are_refused(engine_runs):
    for run in engine_runs[2]:
        assert "The ranks chose different layers for LoRA: [[0, 1], [0, 2]]" in run["differing_selection"]


# ------------------------------------------------------------------------------------------- one-process checks
FORA = FoRAConfig(mode="fora")


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A 1-rank gloo process group and its CPU mesh: fully_shard then makes DTensors in this process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def peft_llama(layers=(0, 1)):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, layers_to_transform=list(layers), lora_dropout=0.0)
    model = get_peft_model(tiny_llama(num_layers=2), config)
    make_stiefel(model, generator=torch.Generator().manual_seed(0))
    return model


def fake_trainer(model):
    callbacks = []
    return SimpleNamespace(
        model=model, args=SimpleNamespace(device=torch.device("cpu")), add_callback=callbacks.append
    )


def test_fsdp1_is_refused_and_fsdp2_is_taken(monkeypatch):
    def args(world_size=2, mode=ParallelMode.DISTRIBUTED, **fsdp_config):
        return SimpleNamespace(fsdp=True, fsdp_config=fsdp_config, world_size=world_size, parallel_mode=mode)

    with pytest.raises(ValueError, match=r"fsdp=True \(FSDP1, .*cannot be combined with mode='fora': FSDP1 flattens"):
        check_fsdp(args(version=1), FORA)
    assert check_fsdp(args(version=2), FORA) == 2
    assert check_fsdp(args(version=1), FoRAConfig(mode="lora")) == 1
    assert check_fsdp(SimpleNamespace(fsdp=False, fsdp_config=None), FORA) is None
    with pytest.raises(ValueError, match=r"\(FSDP2, .*cannot be combined with mode='fora' in a single process"):
        check_fsdp(args(world_size=1, mode=ParallelMode.NOT_PARALLEL, version=2), FORA)
    # One launched rank (`torchrun --nproc_per_node 1`, `accelerate launch --num_processes 1`: FSDP2 on one GPU) is
    # a run FSDP2 shards; it was refused as a single process.
    assert check_fsdp(args(world_size=1, version=2), FORA) == 2
    # Scoring runs on every rank before sharding: the weights must be loaded on every rank.
    one_rank_loading = args(version=2, cpu_ram_efficient_loading="true")
    with pytest.raises(ValueError, match=r"cpu_ram_efficient_loading=True loads the weights on the first rank only"):
        check_fsdp(one_rank_loading, FORA)
    assert check_fsdp(one_rank_loading, FoRAConfig(layers=[0])) == 2  # nothing to score
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match=r"ACCELERATE_USE_FSDP=true \(FSDP1, from `accelerate launch`"):
        check_fsdp(SimpleNamespace(fsdp=False, fsdp_config=None), FORA)


def load_4bit(folder, storage):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=storage,
    )
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, device_map="cpu")


def test_a_4bit_base_needs_a_float_quant_storage(tmp_path):
    pytest.importorskip("bitsandbytes")
    tiny_llama(num_layers=2).save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"stored as torch.uint8 \(bnb_4bit_quant_storage\): FSDP2 cannot shard"):
        prepare_fsdp2(fake_trainer(load_4bit(tmp_path / "model", torch.uint8)), FORA)
    trainer = fake_trainer(load_4bit(tmp_path / "model", torch.bfloat16))
    prepare_fsdp2(trainer, FORA)


def test_weights_not_loaded_on_this_rank_cannot_be_scored():
    with torch.device("meta"):
        model = tiny_llama(num_layers=2)
    with pytest.raises(ValueError, match=r"is on the meta device: .*fsdp_cpu_ram_efficient_loading: false"):
        prepare_fsdp2(fake_trainer(model), FORA)
    prepare_fsdp2(fake_trainer(model), FoRAConfig(layers=[0]))  # nothing to score: accepted


def test_an_optimizer_left_on_the_unsharded_parameters_is_refused():
    model = peft_llama()
    stale = build_fora_optimizer(peft_llama())  # built on other tensors: the model was sharded after
    with pytest.raises(ValueError, match=r"is not a parameter of the model: .*same accelerator.prepare"):
        check_sharded_training(model, stale)


def test_training_that_is_not_sharded_warns(caplog):
    model = peft_llama()
    check_sharded_training(model, build_fora_optimizer(model))
    assert "FSDP2 is configured but the model is not sharded" in caplog.text


def test_mixed_sharded_and_plain_trainables_are_refused(one_rank_mesh):
    from torch.distributed.fsdp import fully_shard

    model = peft_llama()
    fully_shard(model.base_model.model.model.layers[1], mesh=one_rank_mesh)  # layer 0's LoRA stays plain
    with pytest.raises(ValueError, match=r"left the trainable .*layers\.0\..*'got mixed torch.Tensor and DTensor'"):
        check_sharded_training(model, build_fora_optimizer(model))


def sharded_like_accelerate(mesh, shard_placement_fn=None, **optimizer_kwargs):
    """A PEFT Llama sharded by fully_shard after its FoRA optimizer was built, the optimizer then pointed at the
    sharded parameters: accelerate's order (fsdp2_switch_optimizer_parameters)."""
    from torch.distributed.fsdp import fully_shard

    model = peft_llama()
    optimizer = build_fora_optimizer(model, **optimizer_kwargs)
    names = {id(p): n for n, p in model.named_parameters()}
    group_names = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=shard_placement_fn)
    fully_shard(model, mesh=mesh)
    sharded = dict(model.named_parameters())
    for group, param_names in zip(optimizer.param_groups, group_names):
        group["params"] = [sharded[n] for n in param_names]
    return model, optimizer


def test_a_lora_b_sharded_by_columns_is_refused(one_rank_mesh):
    from torch.distributed.tensor import Shard

    by_columns = lambda p: Shard(1) if p.ndim == 2 and p.shape[1] == 4 else None  # noqa: E731  lora_B (d_out, r)
    model, optimizer = sharded_like_accelerate(one_rank_mesh, by_columns)
    with pytest.raises(ValueError, match=r"is sharded as \(Shard\(dim=1\),\) on a 1-D mesh; .* Shard\(0\)"):
        check_sharded_training(model, optimizer)


def test_fully_sharded_model_and_switched_optimizer_pass(one_rank_mesh):
    check_sharded_training(*sharded_like_accelerate(one_rank_mesh))


def test_gathered_adapters_shows_whole_matrices_for_the_logs(one_rank_mesh):
    from torch.distributed.tensor import DTensor

    model, optimizer = sharded_like_accelerate(one_rank_mesh)
    before = {n: p for n, p in model.named_parameters() if "lora_" in n}
    selection = FoRASelection([0, 1], 2, "base_model.model.model.layers")
    with gathered_adapters(model, optimizer):
        inside = {n: p for n, p in model.named_parameters() if "lora_" in n}
        assert not any(isinstance(p, DTensor) for p in inside.values())
        for name, p in inside.items():
            assert torch.equal(p, before[name].full_tensor()), name
        logs = FoRALogs(selection)(model, optimizer)
    assert logs["fora/max_orthogonality_error"] < 1e-5
    after = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert all(after[n] is p for n, p in before.items())  # the sharded parameters are back, the same objects


# ------------------------------------------------------------------------------------- HF Trainer integration
@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_trainer")
    torchrun(HERE / "distributed" / "fsdp_trainer.py", str(out))
    runs = {run: [torch.load(out / f"{run}-rank{k}.pt") for k in range(2)] for run in ("full", "resumed", "qfora")}
    return out, runs


@pytest.mark.slow
@pytest.mark.parametrize("run", ["full", "qfora"])
def test_fora_sft_trainer_under_fsdp2(trainer_runs, run):
    # accelerate's fully_shard (the FSDP plugin forced on the CPU ranks, see fsdp_trainer.force_fsdp2): every lora_B
    # is stepped on its row shard, the ranks agree, B stays orthonormal, and FoRA's logs read the sharded adapters.
    _, runs = trainer_runs
    rank0, rank1 = runs[run]
    assert rank0["stiefel_placements"] == ["(Shard(dim=0),)"] and rank0["stiefel_count"] == 10
    assert rank0["base_placements"] == ["(Shard(dim=0),)"]  # the base (4-bit packed weights included) is sharded
    assert rank0["exp_avg_types"] == ["DTensor"]
    assert rank0["global_step"] == 6 and rank0["chosen"] == rank1["chosen"] and len(rank0["chosen"]) == 2
    for name in rank0["lora"]:
        assert torch.equal(rank0["lora"][name], rank1["lora"][name]), name
    assert {n.split(".layers.")[1].split(".")[0] for n in rank0["lora"]} == {str(i) for i in rank0["chosen"]}
    assert max(orthogonality_error(m).item() for m in rank0["masters"]) < 1e-5
    assert rank0["losses"][-1] < rank0["losses"][0]
    assert all(log["fora/max_orthogonality_error"] < 1e-5 for log in rank0["logs"])
    assert rank0["linear4bit"] == (4 * 7 if run == "qfora" else 0)


@pytest.mark.slow
def test_resume_under_fsdp2_restores_the_cayley_state(trainer_runs):
    # The checkpoint at step 3 is accelerate's sharded one (torch.distributed.checkpoint, DefaultLoadPlanner).
    out, runs = trainer_runs
    assert (out / "full" / "out" / "checkpoint-3" / "optimizer_0").is_dir()
    full, resumed = runs["full"][0], runs["resumed"][0]
    assert resumed["losses"] == pytest.approx(full["losses"], rel=1e-6)
    for name, tensor in full["lora"].items():
        torch.testing.assert_close(resumed["lora"][name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_the_saved_adapter_is_plain_peft_lora(trainer_runs):
    out, runs = trainer_runs
    trained = runs["resumed"][0]["lora"]
    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    assert len(saved) == len(trained)
    model = PeftModel.from_pretrained(tiny_llama(LAYERS, vocab_size=VOCAB), out / "adapter")
    loaded = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    for name, tensor in trained.items():
        assert torch.equal(loaded[name], tensor), name


# ---------------------------------------------------------------------------------------- Axolotl (its own venv)
def test_axolotl_fsdp2_config_scores_only_weights_every_rank_loaded():
    pytest.importorskip("axolotl")
    import yaml
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault
    from pydantic import ValidationError

    cfg = yaml.safe_load((HERE.parent / "example_configs" / "axolotl" / "qfora_llama3_70b_fsdp2.yaml").read_text())
    validated = validate_config(DictDefault(cfg))
    assert validated.fsdp_version == 2 and validated.bnb_config_kwargs["bnb_4bit_quant_storage"] == "bfloat16"
    cfg["fsdp_config"]["cpu_ram_efficient_loading"] = True
    with pytest.raises(ValidationError, match=r"cpu_ram_efficient_loading=True loads the weights on the first rank"):
        validate_config(DictDefault(cfg))
    validate_config(DictDefault({**cfg, "fora_layers": [10, 20]}))  # nothing to score: accepted


def counted_sharded_step(model, optimizer, before_step=lambda: None):
    from host_sync import HostSyncCounter

    ids = torch.arange(10)[None] % 7
    model(input_ids=ids, labels=ids).loss.backward()
    before_step()
    with HostSyncCounter() as syncs:
        optimizer.step()
    optimizer.zero_grad()
    return syncs


def test_the_sharded_step_makes_no_host_sync(one_rank_mesh):
    # Seen before: the first step projected each DTensor lora_B with Cholesky-QR2, whose error check read the
    # factorisation's status to the host twice per parameter. FSDP2Callback now sets the Cayley state up when
    # training starts (a lora_B without full rank is refused there, once); every step after reads nothing back.
    # AdamW fused: the non-fused one reads its step counts, CPU tensors even on a GPU.
    model, optimizer = sharded_like_accelerate(one_rank_mesh, fused=True, qr_period=2)
    trainer = SimpleNamespace(model=model, optimizer=optimizer, fora_selection=None)
    FSDP2Callback(trainer).on_train_begin(None, None, None)
    stiefel = [p for group in optimizer.param_groups if group["stiefel"] for p in group["params"]]
    first, b = stiefel[:2]
    for step in range(3):  # the first step, a periodic QR step (qr_period 2), an ordinary one
        syncs = counted_sharded_step(model, optimizer)
        assert syncs.count == 0, f"step {step}: {syncs.report()}"
    before = first.full_tensor()
    syncs = counted_sharded_step(model, optimizer, lambda: first.grad.to_local().view(-1)[0].fill_(float("nan")))
    assert syncs.count == 0, syncs.report()  # the skip path
    assert torch.equal(first.full_tensor(), before) and optimizer.skipped_steps() == 1
    with torch.no_grad():
        b.to_local().mul_(1.01)
    syncs = counted_sharded_step(model, optimizer)
    assert syncs.count == 0, syncs.report()  # the re-projection path
    assert optimizer.reprojections() == 1 and orthogonality_error(b.full_tensor()) < 1e-5


def test_a_sharded_lora_b_without_full_rank_is_refused_when_training_starts(one_rank_mesh):
    # The one host read the first step used to make per parameter, made once at setup, names the parameter.
    model, optimizer = sharded_like_accelerate(one_rank_mesh)
    name, b = next((n, p) for n, p in model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        b.to_local()[:, 1] = b.to_local()[:, 0]  # two equal columns: no orthonormal basis of the same span
    trainer = SimpleNamespace(model=model, optimizer=optimizer, fora_selection=None)
    with pytest.raises(ValueError, match=rf"Stiefel lora_B {name} of shape \(\d+, 4\) cannot be projected"):
        FSDP2Callback(trainer).on_train_begin(None, None, None)
