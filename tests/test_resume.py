"""Resuming a FoRASFTTrainer run: the values `fora train` passes, and checkpoints whose state files are cut short."""

import json
import shutil

import pytest
import torch
from test_trainer import make_trainer
from transformers import TrainerCallback

from fora_plugin import FoRAConfig, stiefel_parameters


CONFIG = FoRAConfig(fisher_batches=2, lr_stiefel=5e-2)


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A run of 4 steps with a checkpoint at step 2, and its output folder."""
    tmp_path = tmp_path_factory.mktemp("resume")
    trainer = make_trainer(tmp_path, CONFIG, max_steps=4, save_strategy="steps", save_steps=2)
    trainer.train()
    return tmp_path / "out", trainer


class StepCounter(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def resumable(output_dir, tmp_path, **kwargs):
    """A trainer on a copy of ``output_dir`` holding only its first checkpoint."""
    copy = tmp_path / "out"
    shutil.copytree(output_dir / "checkpoint-2", copy / "checkpoint-2")
    shutil.copy(output_dir / "fora_scores.json", copy / "fora_scores.json")
    return copy, make_trainer(tmp_path, CONFIG, max_steps=4, save_strategy="no", **kwargs)


@pytest.mark.parametrize("value", ["true", "True", True])
def test_resume_from_checkpoint_true_as_the_command_line_gives_it_resumes_the_last_checkpoint(
    checkpointed, tmp_path, value
):
    # `fora train CONFIG --resume_from_checkpoint true` gives the string "true" (a YAML `true` gives True).
    full_dir, full = checkpointed
    _, trainer = resumable(full_dir, tmp_path, resume_from_checkpoint=value)
    assert trainer.fora_selection.source == "checkpoint"
    counter = StepCounter()
    trainer.add_callback(counter)
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    assert counter.steps == 2 and trainer.state.global_step == 4  # steps 1-2 came from the checkpoint
    final = dict(stiefel_parameters(full.model))
    for name, weight in stiefel_parameters(trainer.model):
        assert torch.allclose(weight, final[name], atol=1e-6)


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt"])
@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_a_truncated_state_file_is_named_with_the_fix(checkpointed, tmp_path, name, keep):
    full_dir, _ = checkpointed
    copy, trainer = resumable(full_dir, tmp_path)
    path = copy / "checkpoint-2" / name
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    message = rf"Cannot resume from .*checkpoint-2: .*{name} is truncated or corrupt .*earlier checkpoint.*new run"
    with pytest.raises(ValueError, match=message):
        trainer.train(resume_from_checkpoint=str(copy / "checkpoint-2"))


def test_a_corrupt_byte_inside_optimizer_pt_is_caught_too(checkpointed, tmp_path):
    full_dir, _ = checkpointed
    copy, trainer = resumable(full_dir, tmp_path)
    path = copy / "checkpoint-2" / "optimizer.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside a stored tensor: the zip directory is intact, the CRC is not
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"optimizer.pt is truncated or corrupt \(member .* fails its CRC check\)"):
        trainer.train(resume_from_checkpoint=str(copy / "checkpoint-2"))


def test_an_intact_checkpoint_still_resumes(checkpointed, tmp_path):
    full_dir, _ = checkpointed
    copy, trainer = resumable(full_dir, tmp_path)
    trainer.train(resume_from_checkpoint=str(copy / "checkpoint-2"))
    assert trainer.state.global_step == 4
    assert json.loads((copy / "fora_scores.json").read_text())["chosen_layers"] == trainer.fora_selection.chosen


@pytest.mark.parametrize(
    ("process_index", "local_process_index", "save_on_each_node"),
    [(0, 0, False), (2, 0, True), (2, 0, False), (3, 1, True)],
)
def test_the_selection_is_saved_where_hf_saves_the_checkpoint(
    tmp_path, monkeypatch, process_index, local_process_index, save_on_each_node
):
    # Seen before: only the world's main process wrote fora_scores.json, so with save_on_each_node a run resumed on
    # node 1 (no shared filesystem) stopped with "No FoRA selection at .../checkpoint-500/fora_scores.json".
    from transformers import TrainerState, TrainingArguments

    from fora_plugin.selection import SCORES_FILE, FoRASelection
    from fora_plugin.wiring import SaveSelectionCallback

    args = TrainingArguments(output_dir=str(tmp_path), save_on_each_node=save_on_each_node, use_cpu=True)
    monkeypatch.setattr(TrainingArguments, "process_index", property(lambda self: process_index))
    monkeypatch.setattr(TrainingArguments, "local_process_index", property(lambda self: local_process_index))
    state = TrainerState(global_step=500, is_world_process_zero=process_index == 0)
    selection = FoRASelection([1, 3], 4, "model.layers")
    SaveSelectionCallback(selection).on_save(args, state, None)
    saved = tmp_path / "checkpoint-500" / SCORES_FILE
    assert (
        saved.is_file() == args.should_save == (local_process_index == 0 and (save_on_each_node or process_index == 0))
    )
    if args.should_save:
        assert json.loads(saved.read_text())["chosen_layers"] == [1, 3]
