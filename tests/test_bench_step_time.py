"""bench/step_time.py's rows, placements and tables (the timed runs themselves: tests/test_bench_gpu.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest


def load_step_time():
    path = Path(__file__).resolve().parents[1] / "bench" / "step_time.py"
    spec = importlib.util.spec_from_file_location("step_time", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["step_time"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def step_time():
    return load_step_time()


def test_placements_are_the_top_half_and_every_second_layer_from_0(step_time):
    llama_3b = step_time.placements(28)
    assert llama_3b["top half"] == list(range(14, 28))
    assert llama_3b["every 2nd"] == list(range(0, 28, 2))
    assert step_time.placements(5) == {"top half": [3, 4], "every 2nd": [0, 2, 4]}


def test_lora_runs_once_on_all_layers_and_the_selecting_modes_once_per_placement(step_time):
    rows = step_time.runs(16)
    assert rows[0] == ("lora", "all", None)
    assert [(mode, placement) for mode, placement, _ in rows[1:]] == [
        ("fg-lora", "top half"),
        ("fora", "top half"),
        ("fg-lora", "every 2nd"),
        ("fora", "every 2nd"),
    ]
    assert step_time.runs(16, modes=("fora",)) == [
        ("fora", "top half", list(range(8, 16))),
        ("fora", "every 2nd", list(range(0, 16, 2))),
    ]


def test_ratio_table_divides_fora_by_lora_on_all_layers_and_by_fg_lora_on_the_same_layers(step_time):
    def row(mode, placement, ckpt, ms):
        return {"mode": mode, "placement": placement, "checkpointing": ckpt, "ms_per_step": ms}

    rows = [
        row("lora", "all", False, 100.0),
        row("fg-lora", "top half", False, 60.0),
        row("fora", "top half", False, 66.0),
        row("fg-lora", "every 2nd", False, 90.0),
        row("fora", "every 2nd", False, 99.0),
    ]
    assert step_time.find_row(rows, "lora", "top half", False) is rows[0]  # lora has one placement: all
    assert step_time.find_row(rows, "fora", "top half", True) is None
    table = step_time.format_ratio_table(rows).splitlines()
    assert table[2] == "| off | top half | — | — | 100.0 | 60.0 | 66.0 | **0.660** | **1.100** |"
    assert table[3] == "| off | every 2nd | — | — | 100.0 | 90.0 | 99.0 | **0.990** | **1.100** |"
    # Rows of another kind (here: accumulation 4) get a line of their own, beside the frozen base of their kind.
    rows += [
        {**row("lora", "all", False, 400.0), "accumulation": 4},
        {**row("fora", "top half", False, 250.0), "accumulation": 4},
        {**row("frozen", "all", False, 200.0), "accumulation": 4},
    ]
    assert step_time.find_row(rows, "lora", "all", False, accumulation=4) is rows[-3]
    table = step_time.format_ratio_table(rows).splitlines()
    assert table[4] == "| off | top half | accumulation 4 | 200.0 | 400.0 | — | 250.0 | **0.625** | — |"


def test_step_timer_splits_each_step_at_the_optimizer_step(step_time, monkeypatch):
    import torch

    clock = iter([1.0, 1.25, 1.375, 1.5, 2.0, 2.5, 2.625, 2.75])
    host = iter([0.0, 0.5, 1.0, 1.25])  # the thread's CPU time at the optimizer phase's begin and end
    monkeypatch.setattr(step_time.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(step_time.time, "thread_time", lambda: next(host))
    timer = step_time.StepTimer(torch.device("cpu"))
    for _ in range(2):
        timer.on_step_begin(None, None, None)
        timer.on_pre_optimizer_step(None, None, None)
        timer.on_optimizer_step(None, None, None)
        timer.on_step_end(None, None, None)
    # (step, forward + backward, optimizer phase, its optimizer.step, the host's CPU time in the phase)
    assert timer.milliseconds() == [(500.0, 250.0, 250.0, 125.0, 500.0), (750.0, 500.0, 250.0, 125.0, 250.0)]


def test_measure_rows_records_a_failed_row_and_measures_the_others(step_time, monkeypatch):
    import torch

    def fake_row(setting, device, row, *args):
        if row.mode == "fora":
            raise RuntimeError("captured step failed\nsecond line")
        return {"mode": row.mode, "ms_per_step": 1.0}

    monkeypatch.setattr(step_time, "_measure_row", fake_row)
    rows = [step_time.Row("lora", "all", False), step_time.Row("fora", "top half", False)]
    rows.append(step_time.Row("fg-lora", "top half", False))
    errors = []
    seen = []
    setting, cpu = step_time.SETTINGS["tiny"], torch.device("cpu")
    results = step_time.measure_rows(setting, cpu, rows, warmup=1, steps=1, errors=errors, on_row=seen.append)
    assert [r["mode"] for r in results] == ["lora", "fg-lora"] and seen == results
    (failed,) = errors
    assert (failed["mode"], failed["exception"]) == ("fora", "RuntimeError")
    assert failed["message"].startswith("captured step failed") and "second line" in failed["error"]
    with pytest.raises(RuntimeError, match="captured step failed"):  # without a list the error propagates
        step_time.measure_rows(setting, cpu, rows, warmup=1, steps=1)


def test_a_failed_rows_trainer_is_gone_when_the_next_row_starts(step_time, monkeypatch):
    """The release after a failed row runs where the failure's traceback no longer holds the row's frames: its
    trainer (here a stand-in kept alive by a reference cycle, as accelerate's wrappers keep a trainer) is collected
    before the next row, whose peak would otherwise count it."""
    import gc
    import weakref

    import torch

    class Trainer:
        def __init__(self):
            self.me = self  # a cycle: only a collection frees it

    alive = []

    def fake_row(setting, device, row, *args):
        trainer = Trainer()
        alive.append(weakref.ref(trainer))
        if row.mode == "fora":
            raise RuntimeError("failed")
        return {"mode": row.mode, "ms_per_step": 1.0}

    at_release = []

    def release(device):
        gc.collect()
        at_release.append([ref() is not None for ref in alive])

    monkeypatch.setattr(step_time, "_measure_row", fake_row)
    monkeypatch.setattr(step_time, "release", release)
    rows = [step_time.Row("fora", "top half", False), step_time.Row("lora", "all", False)]
    step_time.measure_rows(step_time.SETTINGS["tiny"], torch.device("cpu"), rows, warmup=1, steps=1, errors=[])
    # The failed row's trainer was collected at its release, and the next row's at its own.
    assert at_release == [[False], [False, False]], at_release


def test_timed_steps_see_only_batch_shapes_the_process_ran_before_them(step_time, monkeypatch):
    """Data padded per batch has a new length at almost every step: before the first row at those lengths, one pass
    at each; a later row at the same batches runs none, and neither does a row on fixed-length data. Each row's
    forwards are recorded as they reach the decoder (the shapes, and the tokens TRL counts)."""
    import dataclasses

    import torch

    warmup, steps = 1, 4
    # 16 x 128: the commonsense batches keep lengths of their own (the tiny setting's 32 cuts every one to 32), and
    # truncation drops a few rows, so that the 5 steps run into a second epoch.
    setting = dataclasses.replace(step_time.SETTINGS["tiny"], name="tiny, 16 x 128", batch_size=16, seq_len=128)
    rows = [
        step_time.Row("lora", "all", False, data="commonsense"),
        # An optimizer option changes no kernel: the lora row's passes serve it.
        step_time.Row("fora", "top half", True, data="commonsense", options=(("cuda_graph", False),)),
        step_time.Row("frozen", "all", True, accumulation=2, data="commonsense"),
        step_time.Row("fg-lora", "top half", False),
        # Other options, other kernels: the same batches warmed again.
        step_time.Row("fg-lora", "top half", False, data="commonsense", options=(("input_cast", "peft"),)),
    ]
    calls: list[list[tuple[tuple[int, ...], int]]] = []
    checkpointed: list[bool] = []
    build = step_time.build_model

    def recording_model(*args, **kwargs):
        model = build(*args, **kwargs)
        calls.append([])

        def record(module, args, kwargs):
            calls[-1].append((tuple(kwargs["input_ids"].shape), int(kwargs["attention_mask"].sum())))

        model.model.register_forward_pre_hook(record, with_kwargs=True)
        return model

    warm = step_time.warm_shapes

    def checked_warm_shapes(trainer, model, *args, **kwargs):
        rng = torch.random.get_rng_state()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        new_name = hasattr(base, "is_activation_checkpointing")  # transformers 5.x; the floors' name before
        checkpointed.append(base.is_activation_checkpointing if new_name else base.is_gradient_checkpointing)
        count = warm(trainer, model, *args, **kwargs)
        # train() then runs as it would have: the same random state, no gradient left.
        assert torch.equal(torch.random.get_rng_state(), rng)
        assert all(p.grad is None for p in model.parameters())
        return count

    monkeypatch.setattr(step_time, "build_model", recording_model)
    monkeypatch.setattr(step_time, "warm_shapes", checked_warm_shapes)
    monkeypatch.setattr(step_time, "_WARM_SHAPES", set())  # as in a fresh process
    results = step_time.measure_rows(setting, torch.device("cpu"), rows, warmup=warmup, steps=steps)

    ran_before: set[tuple[int, ...]] = set()
    split = []
    for row, seen in zip(rows, calls):
        first_timed = len(seen) - steps * row.accumulation
        ran_before |= {shape for shape, _ in seen[:first_timed]}
        timed = {shape for shape, _ in seen[first_timed:]}
        assert timed <= ran_before, (row, sorted(timed - ran_before))
        ran_before |= timed
        step_calls = (warmup + steps) * row.accumulation
        split.append((seen[: len(seen) - step_calls], seen[len(seen) - step_calls :]))

    # The pass runs checkpointed where the row's steps do (not holding every layer's activations).
    assert checkpointed == [row.checkpointing for row in rows]
    (lora_pass, lora_steps), (fora_pass, fora_steps), (frozen_pass, frozen_steps), (random_pass, random_steps) = split[
        :4
    ]
    options_pass, options_steps = split[4]
    assert options_steps == lora_steps and {shape for shape, _ in options_pass} == {s for s, _ in lora_steps}
    assert results[4]["shape_warmup"] == len(options_pass)
    # The first row: one pass at each length its steps see, each once.
    lengths = {shape for shape, _ in lora_steps}
    assert len(lengths) > 2 and len(lora_pass) == len(lengths) == results[0]["shape_warmup"]
    assert {shape for shape, _ in lora_pass} == lengths
    # TRL's token count is the steps' alone: the pass's metrics were put back.
    assert results[0]["log"]["num_tokens"] == sum(tokens for _, tokens in lora_steps)
    # The same batches again: no pass.
    assert fora_steps == lora_steps and fora_pass == [] and results[1]["shape_warmup"] == 0
    # The frozen base (no adapter: a pass of its own kind), two batches a step.
    frozen_lengths = {shape for shape, _ in frozen_steps}
    assert len(frozen_pass) == len(frozen_lengths) == results[2]["shape_warmup"]
    assert {shape for shape, _ in frozen_pass} == frozen_lengths
    # Fixed-length data: the warm-up step runs its one shape.
    assert {shape for shape, _ in random_steps} == {(16, 128)} and random_pass == []
    assert results[3]["shape_warmup"] == 0
