"""Peak memory of Fisher scoring against training, through the real FoRASFTTrainer (`fora train`'s recipe).

    python bench/scoring_memory.py [--steps 2] [--fisher-batches 2]

Gemma-3-270M (the quickstart model), 1,102 two-choice rows (example_configs/data/commonsense_mix_train.json), LoRA
r 16 on the paper's five projections, batch 2, max_length 160, gradient checkpointing on, the same data order in
every run: longest rows first, so that the scoring batches and the first training steps are full 160-token batches,
where the peak is (over the file's own order the peak comes at whichever later step meets the longest rows; that is
why a couple of steps suffice). Each run is a fresh subprocess:

- ``fora``: Fisher scoring (in the trainer's ``__init__``), then training on the chosen layers;
- ``fora, layers given``: the same layers given explicitly (``fora_layers``), so nothing is scored: training alone;
- ``lora``: plain LoRA on every layer (``fora_mode: lora``), the same number of steps;
- ``qfora`` and ``qfora, layers given``: the first two on the 4-bit NF4 base (QLoRA's quantisation, as in
  ``example_configs/qfora_llama3_8b.yaml``), where every decoder linear is a ``Linear4bit`` scored from its input x
  and output gradient g. Under checkpointing, x must not outlive the forward: these rows show it.

Memory is the resident set (RSS) read from ``/proc/self/status``: ``VmHWM`` is the kernel's own high-water mark of the
RSS, so no sampling can miss a peak. Writing ``5`` to ``/proc/self/clear_refs`` resets it, which gives the peak of
one phase: scoring (around ``FoRASFTTrainer.fora_score``), training (``on_train_begin`` to ``on_train_end``), and the
whole process (the largest of the phases' and the rest's high-water marks, model loading included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "example_configs" / "quickstart.yaml"
DATA = ROOT / "example_configs" / "data" / "commonsense_mix_train.json"
GiB = 1024**3


def status(key: str) -> int:
    """Bytes of a /proc/self/status entry: VmRSS (the resident set now), VmHWM (its high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"No {key} in /proc/self/status: this benchmark needs Linux.")


class PeakRSS:
    """Peaks of the resident set per phase, and of the whole process (the reset also resets ``ru_maxrss``)."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.process = 0

    def start(self, phase: str) -> None:
        self.process = max(self.process, status("VmHWM"))
        self.peaks[f"{phase} start"] = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def end(self, phase: str) -> None:
        self.peaks[phase] = status("VmHWM")
        self.process = max(self.process, self.peaks[phase])


def worker(run: str, steps: int, fisher_batches: int, layers: str | None, result_path: str) -> None:
    import torch
    from transformers import TrainerCallback

    from fora_plugin.recipe import build_trainer
    from fora_plugin.trainer import FoRASFTTrainer

    torch.set_num_threads(2)
    rss = PeakRSS()
    fora_score = FoRASFTTrainer.fora_score

    def measured_score(self, *args, **kwargs):
        rss.start("scoring")
        try:
            return fora_score(self, *args, **kwargs)
        finally:
            rss.end("scoring")

    FoRASFTTrainer.fora_score = measured_score  # the bench's probe around the trainer's own scoring step

    class TrainingPeak(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            rss.start("training")

        def on_train_end(self, args, state, control, **kwargs):
            rss.end("training")

    with tempfile.TemporaryDirectory() as out:
        rows = json.loads(DATA.read_text())
        rows.sort(key=lambda row: -len(row["instruction"] + row["input"] + row["output"]))  # stable: ties keep order
        data = Path(out) / "longest_first.json"
        data.write_text(json.dumps(rows))
        overrides = [
            "--dataset_name", str(data),
            "--output_dir", out,
            "--gradient_checkpointing", "true",
            "--max_steps", str(steps),
            "--max_length", "160",
            "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "1",
            "--lora_r", "16",
            "--lora_alpha", "32",
            "--lora_dropout", "0.0",
            "--fora_fisher_batches", str(fisher_batches),
            "--train_sampling_strategy", "sequential",  # the same data order in every run
            "--logging_steps", str(steps),
            "--save_strategy", "no",
            "--report_to", "none",
            "--disable_tqdm", "true",
        ]  # fmt: skip
        if run == "lora":
            overrides += ["--fora_mode", "lora"]
        if run == "qfora":
            overrides += ["--load_in_4bit", "true", "--bnb_4bit_quant_type", "nf4", "--use_bnb_nested_quant", "true"]
        if layers is not None:
            overrides += ["--fora_layers", *map(str, json.loads(layers))]
        trainer = build_trainer(str(CONFIG), overrides)
        trainer.add_callback(TrainingPeak())
        trainer.train()
        chosen = trainer.fora_selection.chosen if trainer.fora_selection is not None else None
    rss.process = max(rss.process, status("VmHWM"))
    Path(result_path).write_text(json.dumps({"peaks": {**rss.peaks, "process": rss.process}, "chosen": chosen}))


def measure(run: str, steps: int, fisher_batches: int, layers: list[int] | None = None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        command = [sys.executable, __file__, "--worker", run, "--steps", str(steps)]
        command += ["--fisher-batches", str(fisher_batches), "--result", result.name]
        if layers is not None:
            command += ["--layers", json.dumps(layers)]
        subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "TQDM_DISABLE": "1"})
        measured = json.loads(Path(result.name).read_text())
    print(f"{run} {layers}: {measured}", flush=True)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="training steps per run (default: 2)")
    parser.add_argument("--fisher-batches", type=int, default=2, help="Fisher batches (default: 2)")
    parser.add_argument(
        "--bases", nargs="+", choices=("float", "4bit"), default=["float", "4bit"], help="bases to run (default: both)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--layers", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.fisher_batches, args.layers, args.result)
        return

    rows = []
    if "float" in args.bases:
        fora = measure("fora", args.steps, args.fisher_batches)
        given = measure("fora", args.steps, args.fisher_batches, layers=fora["chosen"])
        lora = measure("lora", args.steps, args.fisher_batches)
        rows += [
            ("fora (scoring, then training)", fora),
            ("fora, layers given (training alone)", given),
            ("lora (all layers)", lora),
        ]
    if "4bit" in args.bases:
        qfora = measure("qfora", args.steps, args.fisher_batches)
        qgiven = measure("qfora", args.steps, args.fisher_batches, layers=qfora["chosen"])
        rows += [
            ("qfora, 4-bit NF4 (scoring, then training)", qfora),
            ("qfora, layers given (training alone)", qgiven),
        ]

    def cell(peaks: dict, key: str) -> str:
        return f"{peaks[key] / GiB:.2f}" if key in peaks else "-"

    print(f"\nGemma-3-270M, {args.steps} steps, batch 2, max_length 160, r 16, gradient checkpointing, "
          f"{args.fisher_batches} Fisher batches; RSS in GiB ({os.cpu_count()} CPUs)\n")  # fmt: skip
    keys = ("scoring start", "scoring", "training start", "training", "process")
    print("| run | at scoring start | scoring peak | at training start | training peak | whole-process peak |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, result in rows:
        print(f"| {name} | " + " | ".join(cell(result["peaks"], key) for key in keys) + " |")
    print()
    if "float" in args.bases:
        scoring, training = fora["peaks"]["scoring"], given["peaks"]["training"]
        print(f"scoring peak / training-alone peak: {scoring / training:.3f} (target <= 1.05)")
        whole = fora["peaks"]["process"] / lora["peaks"]["process"]
        print(f"fora whole run / lora whole run:    {whole:.3f} (target <= 1.0)")
        after = fora["peaks"]["training"] / training
        print(f"training peak after scoring / training alone: {after:.3f} (what scoring leaves behind)")
    if "4bit" in args.bases:
        scoring, training = qfora["peaks"]["scoring"], qgiven["peaks"]["training"]
        print(f"qfora scoring peak / training-alone peak: {scoring / training:.3f} (target <= 1.05)")
        # What the scoring phase adds over the memory it starts from: the x held for x/g scoring shows here.
        added = (scoring - qfora["peaks"]["scoring start"]) / (training - qgiven["peaks"]["training start"])
        print(f"qfora scoring rise / training-alone rise:   {added:.3f} (peak above the phase's starting RSS)")


if __name__ == "__main__":
    main()
