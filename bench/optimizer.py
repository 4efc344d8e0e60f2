"""Cayley-Adam against its own essential matmuls and against AdamW, on real lora_B sets, in one process.

For each set of lora_B shapes it prints, side by side from one run:

- host time (the thread's CPU time until the step returns: on a GPU, the time spent issuing its work) and wall time
  per step after synchronising (median over interleaved rounds, so a change in the machine's load hits every line
  alike) of ``AdamW(fused=True)``, ``AdamW(foreach=True)``, Cayley-Adam before the stacked storage (the old step,
  kept in ``bench/reference_cayley_adam.py``), Cayley-Adam on stacked storage whose views were the parameters (the
  step at ``--stacked-rev``, imported from git, replaced because a parameter must own its storage), Cayley-Adam at
  ``--previous-rev`` (copies of [B, m] into a buffer per bucket), the staged step at ``--staged-rev`` (the buffer
  gathered again in phase 3, each Gram matrix one product: the step the H100 measured on 2026-11-28), Cayley-Adam now
  (the defaults: eager and matrix by matrix on the CPU; on a GPU a dense buffer per bucket, captured as a CUDA graph)
  and each of its implementations forced, eager and on a GPU captured, the step's two essential matmuls alone: the
  Gram matrix [B, m]ᵀ[B, m] and the update [B, m]·C of every shape bucket (about 16·r flops per entry), and the Gram
  matrices alone, one product per matrix and summed from blocks of rows as the staged step forms them;
- kernel-running aten ops per step that the host dispatches, counted with a dispatch mode (views and other
  metadata-only ops are not kernels; a replayed CUDA graph's kernels are not dispatched), and on a GPU the CUDA
  kernels per step that the profiler records;
- words moved per lora_B entry, counted from the ops' inputs and outputs (each distinct tensor an op reads, each it
  writes; a copy's destination and an ``out=`` tensor are written, not read);
- the drift ‖BᵀB − I‖_F after the timed steps.

Sets: LLaMA-3.1-8B's q, k, v, up, down lora_B on 16 layers (FoRA's K = L/2) at r = 32 and r = 16, and the fused
expert lora_B (gate_up_proj and down_proj, 128 experts, PEFT's (d_out, r·E) layout) of Qwen3-30B-A3B on 2 layers at
r = 16 (each expert block its own Stiefel matrix). Shapes come from the models' config.json.

A last table compares one 4096 x r step with the paper's reference approach: the d x d skew matrix W formed and the
Cayley system solved by 5 fixed-point iterations with d x d products. On a GPU, ``--capture-check`` also runs
tests/capture_check.py: the captured step against the eager one over 20 steps of a run.

    OMP_NUM_THREADS=1 taskset -c 1 python bench/optimizer.py     # one thread, as the README's figures
    python bench/optimizer.py --device cuda                       # a GPU: wall time after synchronising
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/capture_check.py

from capture_check import package_at  # noqa: E402
from reference_cayley_adam import ReferenceCayleyAdam  # noqa: E402

from fora_plugin import CayleyAdam  # noqa: E402
from fora_plugin.adapter import expert_blocks  # noqa: E402
from fora_plugin.optim import GRAPH_WARMUP_STEPS, IMPLEMENTATIONS  # noqa: E402
from fora_plugin.optim.cayley_adam import gram_by_row_blocks  # noqa: E402
from fora_plugin.stiefel import orthogonality_error, random_stiefel  # noqa: E402


# (name, {d_out: matrices}, r, experts): LLaMA-3.1-8B (hidden 4096, 8 KV heads of 128, intermediate 14336) on 16
# layers; Qwen3-30B-A3B (hidden 2048, moe_intermediate 768, 128 experts) on 2 layers.
SETS = [
    ("LLaMA-3.1-8B, r=32", {4096: 32, 1024: 32, 14336: 16}, 32, 1),
    ("LLaMA-3.1-8B, r=16", {4096: 32, 1024: 32, 14336: 16}, 16, 1),
    ("Qwen3-30B-A3B experts, r=16", {1536: 2, 2048: 2}, 16, 128),
]


DEVICE = torch.device("cpu")
# The last revision whose Cayley-Adam kept lora_B as views into its stacks.
STACKED_REV = "42ed290"
# The last revision whose Cayley-Adam copied [B, m] of each shape bucket into one buffer (before the three-phase step).
PREVIOUS_REV = "c19dc8c"
# The last revision whose staged step gathered [B, m] again in phase 3 and formed each Gram matrix in one product
# (the step the H100 measured on 2026-11-28, bench/results/h100-2026-11-28).
STAGED_REV = "87eab16"
# label -> (CayleyAdam of an older revision, its keyword arguments), where git can give it
OLDER: dict[str, tuple[type, dict]] = {}


def load_older(stacked_rev: str, previous_rev: str, staged_rev: str = "") -> None:
    """:data:`OLDER`'s rows: the stacked-views step, the previous step and the staged step before its buffer lived
    from phase 1 to phase 3 (forced staged, captured on a GPU as today's default), from git (none where git cannot)."""
    OLDER.clear()
    rows = (
        ("CayleyAdam stacked views", stacked_rev, {}),
        ("CayleyAdam, a buffer per bucket", previous_rev, {}),
        ("CayleyAdam staged, gathered twice", staged_rev, {"implementation": "staged"}),
    )
    for label, rev, options in rows:
        package = package_at(rev) if rev else None
        if package is not None:
            OLDER[f"{label} ({rev})"] = (package.CayleyAdam, options)
        elif rev:
            print(f"(no row for {label}: git cannot give revision {rev} here)")


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def cuda_kernels(step, steps: int = 3) -> float | None:
    """CUDA kernels per call of ``step`` as the profiler records them (a replayed graph's included); None off CUDA."""
    if DEVICE.type != "cuda":
        return None
    synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        synchronize()
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels) / steps


def lora_b_set(d_outs: dict[int, int], r: int, experts: int, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for d_out, count in d_outs.items():
        for _ in range(count):
            weight = torch.empty(d_out, r * experts)
            for block in expert_blocks(weight, experts):
                block.copy_(random_stiefel(d_out, r, generator=gen))
            p = torch.nn.Parameter(weight.to(DEVICE))
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(DEVICE)
            params.append(p)
    return params


def essential_matmuls(d_outs: dict[int, int], r: int, experts: int):
    """The two batched products the step cannot do without, per shape bucket, on (n, d, 2r) buffers."""
    gen = torch.Generator().manual_seed(1)
    buckets = []
    for d_out, count in d_outs.items():
        n = count * experts
        P = torch.randn(n, d_out, 2 * r, generator=gen).to(DEVICE)
        buckets.append((P, torch.empty_like(P), (torch.randn(n, 2 * r, 2 * r, generator=gen) * 1e-3).to(DEVICE)))

    def run():
        for P, Q, C in buckets:
            torch.bmm(P.mT, P)  # [B, m]ᵀ[B, m]
            torch.bmm(P, C, out=Q)  # [B, m]·C

    return run


def gram_products(d_outs: dict[int, int], r: int, experts: int) -> dict[str, Callable[[], None]]:
    """The staged step's Gram matrices [B, m]ᵀ[B, m] of every shape bucket alone, two ways: one product per matrix
    (what the essential matmuls run), and summed from blocks of rows (the step's ``gram_by_row_blocks``)."""
    gen = torch.Generator().manual_seed(2)
    buffers = [torch.randn(count * experts, d_out, 2 * r, generator=gen).to(DEVICE) for d_out, count in d_outs.items()]

    def whole():
        for P in buffers:
            torch.bmm(P.mT, P)

    def blocks():
        for P in buffers:
            gram_by_row_blocks(P)

    return {"Gram matrices alone, one product per matrix": whole, "Gram matrices alone, blocks of rows": blocks}


_WRITE_ONLY = {"copy_", "_foreach_copy_", "fill_", "zero_", "_foreach_zero_"}
_NOT_KERNELS = {
    "_record_function_enter_new",
    "_record_function_exit",
    "is_set_to",
    "detach",
    "lift_fresh",
    "_unsafe_view",
}


class StepCounter(TorchDispatchMode):
    """Kernel-running aten ops, and words read and written, of what runs inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = defaultdict(int)
        self.words = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = func(*args, **kwargs)
        if func.is_view or name in _NOT_KERNELS:
            return out
        self.ops[name] += 1
        schema_args = func._schema.arguments
        read, written = {}, {}
        for index, argument in enumerate(schema_args):
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            tensors = value if isinstance(value, (list, tuple)) else [value]
            writes = argument.alias_info is not None and argument.alias_info.is_write
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
                    if writes:
                        written[key] = t.numel()
                    if not writes or not (argument.is_out or name in _WRITE_ONLY):
                        read[key] = t.numel()
        results = out if isinstance(out, (list, tuple)) else [out]
        for t in results:
            if isinstance(t, torch.Tensor):
                written.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()), t.numel())
        self.words += sum(read.values()) + sum(written.values())
        return out


def count(step) -> StepCounter:
    with StepCounter() as counter:
        step()
    return counter


def timed_rounds(candidates: dict[str, callable], rounds: int) -> dict[str, tuple[float, float]]:
    """Median (host, wall) seconds per call: the thread's CPU time until the call returns (what issuing the work
    costs the host; on a CPU, the work itself), and the wall time until the device has finished it. Each round runs
    every candidate once, in turn."""
    samples = defaultdict(list)
    for _ in range(rounds):
        for name, run in candidates.items():
            synchronize()
            cpu, wall = time.thread_time(), time.perf_counter()
            run()
            host = time.thread_time() - cpu
            synchronize()
            samples[name].append((host, time.perf_counter() - wall))
    return {
        name: (statistics.median(c for c, _ in values), statistics.median(w for _, w in values))
        for name, values in samples.items()
    }


def drift(params: list[torch.Tensor], experts: int) -> float:
    return max(orthogonality_error(expert_blocks(p.detach(), experts)).max().item() for p in params)


def bench_set(name: str, d_outs: dict[int, int], r: int, experts: int, rounds: int) -> dict[str, dict[str, float]]:
    """The set's table (printed); returns, per implementation run both eager and captured (a GPU), the largest
    difference of their parameters after the same steps: a check of the capture at the set's real shapes."""
    entries = sum(d * count * r * experts for d, count in d_outs.items())
    buckets = len(d_outs)
    group = {"num_experts": experts} if experts > 1 else {}
    optimizers = {
        "AdamW(fused=True)": torch.optim.AdamW(lora_b_set(d_outs, r, experts), lr=1e-3, fused=True),
        "AdamW(foreach=True)": torch.optim.AdamW(lora_b_set(d_outs, r, experts), lr=1e-3, foreach=True),
        "CayleyAdam before the stacks (old step)": ReferenceCayleyAdam(
            [{"params": lora_b_set(d_outs, r, experts), **group}]
        ),
        **{
            label: older([{"params": lora_b_set(d_outs, r, experts), **group}], **options)
            for label, (older, options) in OLDER.items()
        },
        "CayleyAdam now": CayleyAdam([{"params": lora_b_set(d_outs, r, experts), **group}]),
    }
    # Each implementation forced, eager and (on a GPU) captured; "CayleyAdam now" takes the defaults (on a GPU the
    # staged step captured: the same work as that row, built as a user's optimizer is). No row apart
    # for cuSOLVER: the eager CUDA step runs its small linear algebra under cuSOLVER itself, as the capture does.
    for implementation in IMPLEMENTATIONS:
        for cuda_graph in (False, True) if DEVICE.type == "cuda" else (False,):
            label = f"CayleyAdam now, {implementation.replace('_', ' ')}, {'captured' if cuda_graph else 'eager'}"
            optimizers[label] = CayleyAdam(
                [{"params": lora_b_set(d_outs, r, experts), **group}],
                implementation=implementation,
                cuda_graph=cuda_graph,
            )
    candidates = {label: opt.step for label, opt in optimizers.items()}
    candidates["essential matmuls alone"] = essential_matmuls(d_outs, r, experts)
    candidates.update(gram_products(d_outs, r, experts))
    for label, run in list(candidates.items()):  # warm-up: state made, stacks built, the captured step captured
        try:
            for _ in range(GRAPH_WARMUP_STEPS + 1):
                run()
        except Exception as error:  # noqa: BLE001  (a step that cannot run here must not lose the others' rows)
            print(f"({label}: left out, its first steps raised {type(error).__name__}: {error})")
            del candidates[label]
            optimizers.pop(label, None)
    counters = {label: count(run) for label, run in candidates.items()}
    kernels = {label: cuda_kernels(run) for label, run in candidates.items()}
    times = timed_rounds(candidates, rounds)
    column = 1 if DEVICE.type == "cuda" else 0  # on a GPU the host's CPU time is not the step's: ratios of wall time
    essential = times["essential matmuls alone"][column]
    print(f"### {name}: {sum(d_outs.values())} lora_B, {buckets} shape buckets, {entries / 1e6:.1f} M entries")
    print()
    print(
        "| step | host ms | wall ms | × essential | × fused AdamW | aten ops / step | CUDA kernels / step "
        "| words / entry |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, (cpu, wall) in times.items():
        counter = counters[label]
        ops = sum(counter.ops.values())
        cuda = "—" if kernels[label] is None else f"{kernels[label]:.0f}"
        print(
            f"| {label} | {cpu * 1e3:.2f} | {wall * 1e3:.2f} | {(cpu, wall)[column] / essential:.2f} "
            f"| {(cpu, wall)[column] / times['AdamW(fused=True)'][column]:.1f} | {ops} | {cuda} "
            f"| {counter.words / entries:.1f} |"
        )
    before = optimizers["CayleyAdam before the stacks (old step)"]
    now = optimizers["CayleyAdam now"]
    steps = rounds + 3
    captures = captured_against_eager(optimizers, experts)
    for implementation, c in captures.items():
        print(
            f"Captured against eager ({implementation}), the same {c['steps']} steps from the same start: max |Δ| "
            f"{c['max_abs_diff']:.1e}, {c['relative']:.1e} of the parameters' largest entry (goal ≤ 1e-6)."
        )
    print()
    print(
        f"Drift ‖BᵀB − I‖_F after {steps} steps: before {drift(before.param_groups[0]['params'], experts):.1e}, "
        f"now {drift(now.param_groups[0]['params'], experts):.1e}. Kernel-running ops of one step now: "
        + ", ".join(f"{op} {n}" for op, n in sorted(counters["CayleyAdam now"].ops.items(), key=lambda x: -x[1]))
    )
    print()
    return captures


def captured_against_eager(optimizers: dict[str, torch.optim.Optimizer], experts: int) -> dict[str, dict[str, float]]:
    """For each implementation timed eager and captured: both started from the same seed (parameters and gradients)
    and stepped the same number of times, so their parameters must agree to fp32 rounding."""
    out = {}
    for implementation in IMPLEMENTATIONS:
        label = f"CayleyAdam now, {implementation.replace('_', ' ')}"
        eager, captured = optimizers.get(f"{label}, eager"), optimizers.get(f"{label}, captured")
        if eager is None or captured is None:
            continue
        pairs = list(zip(eager.param_groups[0]["params"], captured.param_groups[0]["params"]))
        # torch's max, not Python's: a NaN anywhere must show (Python's max keeps a number over a later NaN).
        diff = torch.stack([(p.detach().double() - q.detach().double()).abs().max() for p, q in pairs]).max().item()
        scale = torch.stack([p.detach().double().abs().max() for p, _ in pairs]).max().item()
        steps = eager.state[pairs[0][0]].get("step")
        out[implementation] = {
            "max_abs_diff": diff,
            "relative": diff / scale,
            "steps": int(torch.as_tensor(steps).flatten()[0].item()) if steps is not None else -1,
            "matrices": len(pairs) * experts,
        }
    return out


def _profiled_eager_steps(d_outs: dict[int, int], r: int, experts: int, steps: int, with_stack: bool = False):
    """The torch profiler after ``steps`` eager Cayley-Adam steps (the default implementation) on a fresh set: the
    ops a capture records and replays, launch by launch (a replayed graph shows as one op), its state made before."""
    optimizer = CayleyAdam([{"params": lora_b_set(d_outs, r, experts), "num_experts": experts}], cuda_graph=False)
    for _ in range(GRAPH_WARMUP_STEPS + 1):  # the state made: not profiled
        optimizer.step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if DEVICE.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    synchronize()
    with torch.profiler.profile(activities=activities, with_stack=with_stack) as profiler:
        for _ in range(steps):
            optimizer.step()
        synchronize()
    return profiler


def profile_step(d_outs: dict[int, int], r: int, experts: int, steps: int = 3, rows: int = 15) -> str:
    """The torch profiler's top ops (by device time on a GPU, CPU time elsewhere) of ``steps`` eager Cayley-Adam
    steps; the captured step's kernels per step are in bench_set's table."""
    profiler = _profiled_eager_steps(d_outs, r, experts, steps)
    key = "self_device_time_total" if DEVICE.type == "cuda" else "self_cpu_time_total"
    return profiler.key_averages().table(sort_by=key, row_limit=rows)


# The step's phases, by the functions that run them (fora_plugin/optim/cayley_adam.py), either implementation.
PHASES = {
    "_measure_staged": "1: moments and Gram matrices",
    "_measure_per_matrix": "1: moments and Gram matrices",
    "_cayley_adam_deltas": "2: the 2r x 2r algebra",
    "_update_staged": "3: the update",
    "_update_per_matrix": "3: the update",
}


def _phase_of(event) -> str:
    """The phase whose function ``event`` (a profiler event) ran under; "rest of the step" outside them."""
    while event is not None:
        name = event.name.rsplit(": ", 1)[-1]  # a Python function's event is named "file.py(line): function"
        if name in PHASES:
            return PHASES[name]
        event = event.cpu_parent
    return "rest of the step"


def profile_phases(d_outs: dict[int, int], r: int, experts: int, steps: int = 3) -> dict[str, dict[str, float]]:
    """Where ``steps`` eager Cayley-Adam steps (the default implementation, the ops a capture replays) spend their
    time, phase by phase: host ms a step in the phase's functions (under the profiler's Python tracing, which slows
    the host) and, on a GPU, the kernels a step each phase launches and their ms a step."""
    profiler = _profiled_eager_steps(d_outs, r, experts, steps, with_stack=True)
    return phase_times(profiler.events(), steps)


def phase_times(events, steps: int) -> dict[str, dict[str, float]]:
    """:func:`profile_phases`' table from a profiler's events (those of ``steps`` steps): each phase's functions'
    host time, and the kernels (with their durations, µs) that the CPU events under them launched."""
    phases = {name: {"host_ms": 0.0, "kernels": 0, "kernel_ms": 0.0} for name in [*dict.fromkeys(PHASES.values())]}
    rest = phases["rest of the step"] = {"host_ms": 0.0, "kernels": 0, "kernel_ms": 0.0}
    for event in events:
        function = event.name.rsplit(": ", 1)[-1]
        if event.name.startswith("Optimizer.step#"):  # torch's range around the whole step
            rest["host_ms"] += event.cpu_time_total / 1e3 / steps
        if function in PHASES:
            phases[PHASES[function]]["host_ms"] += event.cpu_time_total / 1e3 / steps
        if event.kernels:  # a CPU event that launched device kernels (the runtime call under an op)
            phase = phases[_phase_of(event)]
            phase["kernels"] += len(event.kernels) / steps
            phase["kernel_ms"] += sum(k.duration for k in event.kernels) / 1e3 / steps
    rest["host_ms"] -= sum(p["host_ms"] for name, p in phases.items() if name in PHASES.values())
    return phases


def phases_table(phases: dict[str, dict[str, float]]) -> str:
    gpu = DEVICE.type == "cuda"
    lines = ["| phase | host ms a step (traced) | kernels a step | kernel ms a step |", "|---|---:|---:|---:|"]
    for name, p in phases.items():
        host = f"{p['host_ms']:.2f}"
        kernels, kernel_ms = (f"{p['kernels']:.0f}", f"{p['kernel_ms']:.3f}") if gpu else ("—", "—")
        lines.append(f"| {name} | {host} | {kernels} | {kernel_ms} |")
    return "\n".join(lines)


def dense_reference_step(B: torch.Tensor, G: torch.Tensor, lr: float, iters: int = 5) -> torch.Tensor:
    """The reference implementation's shape of work: a d x d W and d x d products in the fixed-point solve."""
    W_hat = G @ B.T - 0.5 * B @ (B.T @ G @ B.T)  # (d, d)
    W = W_hat - W_hat.T  # (d, d)
    Y = B - lr * (W @ B)
    for _ in range(iters):
        Y = B - (lr / 2) * (W @ (B + Y))
    return Y


def bench_dense(r: int, rounds: int, d: int = 4096) -> None:
    (single,) = lora_b_set({d: 1}, r, 1)
    # Eager: this row weighs the work of the two algorithms, not a capture's saving of launches.
    opt = CayleyAdam([single], cuda_graph=False)
    B, G = single.detach().clone(), single.grad.clone()
    for run in (opt.step, opt.step):
        run()
    times = timed_rounds({"ours": opt.step, "dense": lambda: dense_reference_step(B, G, 1e-3)}, max(3, rounds // 3))
    ours, dense = (times[k][0 if DEVICE.type == "cpu" else 1] for k in ("ours", "dense"))
    print(f"| one {d} x {r} matrix | ms / step | vs ours |")
    print("|---|---:|---:|")
    print(f"| dense d x d Cayley (W formed, 5 fixed-point iterations) | {dense * 1e3:.1f} | {dense / ours:.2g}x |")
    print(f"| ours: CayleyAdam eager, exact step on the span of [B, m] | {ours * 1e3:.2f} | 1x |")
    print()


def capture_checks() -> list[dict]:
    """tests/capture_check.py on this device: the captured step against the eager one, every kind (CUDA only)."""
    from capture_check import KINDS, captured_against_eager
    from host_sync import HostSyncCounter

    results = [captured_against_eager(kind, DEVICE, sync_counter=HostSyncCounter) for kind in KINDS]
    print("| kind | max |Δ| parameters | max |Δ| state | dtypes equal | skipped (eager, captured) | host syncs |")
    print("|---|---:|---:|---|---|---:|")
    for r in results:
        print(
            f"| {r['kind']} | {r['max_param_diff']:.1e} | {r['max_state_diff']:.1e} | {r['dtypes_match']} "
            f"| {r['skipped']} | {r['syncs']} |"
        )
    print()
    return results


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (default: 10)")
    parser.add_argument("--sets", nargs="*", type=int, help="indices into SETS to run (default: all)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    parser.add_argument(
        "--stacked-rev",
        default=STACKED_REV,
        help=f"git revision of the stacked-views step to time beside today's (default: {STACKED_REV}; '' for none)",
    )
    parser.add_argument(
        "--previous-rev",
        default=PREVIOUS_REV,
        help=f"git revision of the step with a buffer per bucket (default: {PREVIOUS_REV}; '' for none)",
    )
    parser.add_argument(
        "--staged-rev",
        default=STAGED_REV,
        help=f"git revision of the staged step that gathered twice (default: {STAGED_REV}; '' for none)",
    )
    parser.add_argument("--capture-check", action="store_true", help="the captured step against the eager (CUDA)")
    args = parser.parse_args()
    DEVICE = torch.device(args.device)
    load_older(args.stacked_rev, args.previous_rev, args.staged_rev)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(
        f"device {DEVICE}, CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print()
    for index, (name, d_outs, r, experts) in enumerate(SETS):
        if args.sets is None or index in args.sets:
            bench_set(name, d_outs, r, experts, args.rounds)
    bench_dense(32, args.rounds)
    if args.capture_check:
        capture_checks()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
