"""The row-sharded Cayley step (FSDP2's Shard(0) lora_B) against the dense single-matrix step.

The math is checked without processes: split B, m into row blocks (uneven, one empty), sum the blocks' Gram
matrices (what the all-reduce does), step each block and stack the blocks again. Then CayleyAdam itself runs on
DTensors in 3 gloo processes (rows 2/2/0, 3/3/1, ...) and is compared with CayleyAdam on the whole matrices.
"""

import copy
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dense_reference import dense_cayley

from fora_plugin.optim import CayleyAdam
from fora_plugin.stiefel import (
    cayley_coefficients,
    cayley_step,
    cholesky_qr,
    orthogonality_error,
    qr_retraction,
    random_stiefel,
)


F64 = torch.float64
SPLITS = [5, 0, 4, 2]  # rows per rank: uneven, one rank holds none


def row_blocks(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.split(SPLITS, dim=-2))


@pytest.mark.parametrize("solver", ["exact", "fixed_point"])
def test_row_blocks_with_the_summed_gram_give_the_dense_cayley_step(solver):
    gen = torch.Generator().manual_seed(0)
    d, r = sum(SPLITS), 3
    B = torch.stack([random_stiefel(d, r, generator=gen, dtype=F64) for _ in range(2)])  # (2, d, r)
    G = torch.randn(2, d, r, generator=gen, dtype=F64)
    tau = torch.tensor([0.05, 0.3], dtype=F64)
    blocks = row_blocks(torch.cat((B, G), dim=-1))  # (2, d_k, 2r) each
    gram = sum(block.mT @ block for block in blocks)  # the all-reduce(SUM) of the local Gram matrices
    sharded = torch.cat(
        [block @ cayley_coefficients(block, tau, gram=gram, solver=solver)[..., :r] for block in blocks], dim=-2
    )
    assert torch.max(torch.abs(sharded - cayley_step(B, G, tau, solver=solver))) < 1e-12
    if solver == "exact":
        for i in range(2):
            assert torch.max(torch.abs(sharded[i] - dense_cayley(B[i], G[i], tau[i].item()))) < 1e-12


@pytest.mark.parametrize("noise", [1e-3, 0.5])
def test_cholesky_qr_of_row_blocks_equals_the_sign_fixed_qr(noise):
    gen = torch.Generator().manual_seed(1)
    d, r = sum(SPLITS), 4
    X = random_stiefel(d, r, generator=gen, dtype=F64) + noise * torch.randn(d, r, generator=gen, dtype=F64)
    blocks = row_blocks(X)
    for _ in range(2):  # Cholesky-QR2: the second pass with the Gram matrix of the first result
        gram = sum(block.mT @ block for block in blocks)
        blocks = [cholesky_qr(block, gram) for block in blocks]
    Q = torch.cat(blocks, dim=-2)
    assert torch.max(torch.abs(Q - qr_retraction(X))) < 1e-12
    assert orthogonality_error(Q) < 1e-13


def test_cholesky_qr_refuses_dependent_columns():
    X = torch.ones(6, 2, dtype=F64)
    with pytest.raises(ValueError, match=r"not positive definite.*dependent columns"):
        cholesky_qr(X, X.T @ X)


# ---- CayleyAdam on DTensors, 3 processes --------------------------------------------------------------------------

WORLD = 3
# (d, r·E, E, dtype): rows over 3 ranks by torch.chunk: 4 -> 2/2/0, 7 -> 3/3/1, 9 -> 3/3/3, 958 -> 320/320/318 (the
# staged step sums 320 rows' Gram matrices from 5 blocks of 64, 318 rows' in one product); fp32 for the master path.
SHAPES = [(4, 2, 1, F64), (7, 3, 1, F64), (7, 3, 1, F64), (9, 6, 2, F64), (9, 2, 1, torch.float32), (958, 4, 1, F64)]
STEPS = 5
NAN_STEP, NAN_PARAM, NAN_ROW = 2, 1, 4  # row 4 of a 7-row matrix lives on rank 1 only


def _initial_points() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    points = []
    for d, width, experts, dtype in SHAPES:
        blocks = [random_stiefel(d, width // experts, generator=gen, dtype=F64) for _ in range(experts)]
        point = torch.stack(blocks, dim=-1).reshape(d, width)  # PEFT's layout: expert e = columns e, e + E, ...
        point[0, 0] += 1e-3  # off the manifold: the first step projects it
        points.append(point.to(dtype))
    return points


def _gradients(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(d, width, generator=gen, dtype=dtype) for d, width, _, dtype in SHAPES]
    if step == NAN_STEP:
        grads[NAN_PARAM][NAN_ROW, 0] = float("nan")
    return grads


def _optimizer(params: list[torch.Tensor], implementation: str | None = None) -> CayleyAdam:
    plain = [p for p, (_, _, e, _) in zip(params, SHAPES) if e == 1]
    experts = [p for p, (_, _, e, _) in zip(params, SHAPES) if e == 2]
    return CayleyAdam(
        [{"params": plain}, {"params": experts, "num_experts": 2}],
        lr=0.05,
        qr_period=3,
        reproject_threshold=1e-2,
        implementation=implementation,
    )


def _dtensor_worker(rank: int, port: int, out: str, implementation: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        # As accelerate does under FSDP2: the optimizer is built on plain parameters, then its groups get the
        # sharded ones. Nothing may be cached by identity in between.
        params = [torch.nn.Parameter(x.clone()) for x in _initial_points()]
        opt = _optimizer(params, implementation)
        sharded = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in params]
        by_id = {id(p): s for p, s in zip(params, sharded)}
        for group in opt.param_groups:
            group["params"] = [by_id[id(p)] for p in group["params"]]
        for step in range(STEPS):
            for s, g in zip(sharded, _gradients(step)):
                s.grad = distribute_tensor(g, mesh, [Shard(0)])
            opt.step()
        # A resume from the optimizer's own state dict continues identically (built on DTensors this time).
        resumed_params = [
            torch.nn.Parameter(distribute_tensor(s.detach().full_tensor(), mesh, [Shard(0)])) for s in sharded
        ]
        resumed = _optimizer(resumed_params, implementation)
        resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
        for s, q, g in zip(sharded, resumed_params, _gradients(STEPS)):
            s.grad = distribute_tensor(g, mesh, [Shard(0)])
            q.grad = distribute_tensor(g, mesh, [Shard(0)])
        opt.step()
        resumed.step()
        result = {
            "local_rows": [s.to_local().shape[0] for s in sharded],
            "params": [s.full_tensor() for s in sharded],
            "resumed_equal": all(torch.equal(s.to_local(), q.to_local()) for s, q in zip(sharded, resumed_params)),
            "exp_avg": [opt.state[s]["exp_avg"].full_tensor() for s in sharded],
            "exp_avg_is_sharded": all(
                isinstance(opt.state[s]["exp_avg"], DTensor) and opt.state[s]["exp_avg"].placements == (Shard(0),)
                for s in sharded
            ),
            "master": opt.state[sharded[-1]]["master"].full_tensor() if "master" in opt.state[sharded[-1]] else None,
            "scalars": {
                key: [opt.state[s][key].clone() for s in sharded]
                for key in ("exp_avg_sq", "step", "skipped_steps", "reprojections")
            },
            "scalars_are_plain": all(type(opt.state[s]["exp_avg_sq"]) is torch.Tensor for s in sharded),
        }
        torch.save(result, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@pytest.mark.parametrize("implementation", ["per_matrix", "staged"])
def test_cayley_adam_on_row_sharded_dtensors_equals_the_whole_matrix_run(tmp_path, implementation):
    """Each implementation on row shards (the staged one is a GPU's default) against the whole matrices stepped
    matrix by matrix."""
    mp.spawn(_dtensor_worker, args=(_free_port(), str(tmp_path / "result"), implementation), nprocs=WORLD, join=True)
    results = [torch.load(f"{tmp_path / 'result'}.{rank}", weights_only=False) for rank in range(WORLD)]

    params = [torch.nn.Parameter(x.clone()) for x in _initial_points()]
    reference = _optimizer(params)
    for step in range(STEPS + 1):
        for p, g in zip(params, _gradients(step)):
            p.grad = g
        reference.step()

    assert [r["local_rows"] for r in results] == [[2, 3, 3, 3, 3, 320], [2, 3, 3, 3, 3, 320], [0, 1, 1, 3, 3, 318]]
    for result in results:  # every rank holds the same whole matrices
        assert result["exp_avg_is_sharded"] and result["scalars_are_plain"] and result["resumed_equal"]
        for p, got, m_got, (_, _, _, dtype) in zip(params, result["params"], result["exp_avg"], SHAPES):
            tol = 1e-12 if dtype == F64 else 1e-5
            assert torch.max(torch.abs(got - p.detach())) < tol
            assert torch.max(torch.abs(m_got - reference.state[p]["exp_avg"])) < tol
        for key, values in result["scalars"].items():
            for p, value, (_, _, _, dtype) in zip(params, values, SHAPES):
                rtol = 1e-12 if dtype == F64 else 1e-6
                assert torch.allclose(value.double(), reference.state[p][key].double(), rtol=rtol), key
    # The NaN on rank 1's rows made every rank skip that matrix's step, and only that one.
    assert [int(s) for s in results[0]["scalars"]["skipped_steps"][:3]] == [0, 1, 0]
    assert results[0]["scalars"]["step"][3].tolist() == [STEPS + 1] * 2  # per-expert counters
    for (d, width, experts, dtype), p in zip(SHAPES, results[0]["params"]):
        blocks = p.double().view(d, width // experts, experts).permute(2, 0, 1)
        assert torch.all(orthogonality_error(blocks) < (1e-12 if dtype == F64 else 1e-5))
