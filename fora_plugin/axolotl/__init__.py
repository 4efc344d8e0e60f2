"""FoRA as an Axolotl plugin: ``plugins: [fora_plugin.axolotl.FoRAPlugin]`` plus ``fora_*`` keys.

May import: axolotl.args, checkpoints, compatibility, config, errors, models, training, wiring.
"""

import functools
import logging
from importlib.metadata import entry_points

from axolotl.integrations.base import PLUGIN_ENTRY_POINT_GROUP, BasePlugin
from axolotl.integrations.liger.plugin import LIGER_FLAGS
from axolotl.utils.dict import DictDefault
from axolotl.utils.logging import get_logger
from axolotl.utils.train import determine_last_checkpoint
from peft import PeftModel
from transformers import Trainer

from ..checkpoints import check_checkpoint_files
from ..compatibility import check_cuda_graph, check_liger
from ..config import PREFIX, FoRAConfig
from ..errors import FoRAInputError, FoRAInputTypeError
from ..models import resolve_model_path
from ..training import fora_optimizer, prepare_fora_training, score_on_trainer
from ..wiring import FoRALogs, active_lora_config, set_input_cast
from .args import LORA_KERNELS, PLUGIN_NAME, FoRAArgs, fora_config_from, fora_enabled


__all__ = ["PLUGIN_NAME", "FoRAArgs", "FoRAPlugin"]

LOG = get_logger(__name__)


class FoRAPlugin(BasePlugin):
    """Fisher-selected layers and Stiefel ``lora_B`` for an Axolotl LoRA run.

    Axolotl loads the model, wraps it with LoRA on every layer the YAML targets and builds its trainer as usual.
    Then, in ``post_trainer_create`` (the trainer's dataloader and loss exist, its optimizer does not yet):

    1. the base model (adapters disabled) is scored through the trainer's own train batches and ``compute_loss``:
       the data, masks, packing and loss that training will use;
    2. the adapter is taken off and put back under the same name, with the same LoraConfig object, on the chosen
       layers only, and its ``lora_B`` made Stiefel;
    3. the backward stops at the lowest adapted layer, with activation checkpointing too
       (:mod:`fora_plugin.backward`);
    4. the trainer gets FoRA's optimizer, FoRA's log entries and the callback that saves the selection in
       checkpoints; under DeepSpeed ZeRO-1/2, FoRA's ZeRO client optimizer and its checkpoint callback
       (:mod:`fora_plugin.zero`); under FSDP2 (``fsdp_config``), the checks and callback of :mod:`fora_plugin.fsdp`,
       and logs read from the adapters gathered whole.

    ``adapter: qlora`` (a 4-bit NF4 base, ``load_in_4bit: true``) is QFoRA: the base is scored through the quantized
    linears' inputs and output gradients, and the adapter is the same.

    Axolotl 0.21 loads the plugins a config lists by their dotted path only: ``plugins: [fora]`` (this package's
    entry point name) cannot load, and the run stops with one line that names ``fora_plugin.axolotl.FoRAPlugin``
    (:class:`_ShortPluginName`).

    Every step is a function that ``FoRASFTTrainer`` calls too (:mod:`fora_plugin.training`,
    :mod:`fora_plugin.wiring`), so both give the same layers, adapters, optimizer, logs and
    ``fora_scores.json``/``.png``.

    Every hook first checks that the YAML lists the plugin: an installed plugin is registered by its entry point
    for every Axolotl run, and a plugin registered for one config stays registered in the process.
    """

    def get_input_args(self) -> str:
        return f"{FoRAArgs.__module__}.{FoRAArgs.__name__}"

    def register(self, cfg: DictDefault) -> None:
        if not fora_enabled(cfg):
            keys = sorted(key for key in cfg if key.startswith(PREFIX))
            if keys:
                LOG.warning(f"{keys} are set but `plugins` does not list {PLUGIN_NAME}: FoRA is off for this run.")
            return
        # register sees the config before Axolotl reads anything from it: the only point where a model that
        # needs a conversion (the bundled Gemma GGUF, a .gguf path) can become a folder for the tokenizer, the
        # model config and the model alike.
        for key in ("base_model", "base_model_config", "tokenizer_config"):
            if isinstance(cfg.get(key), str):
                cfg[key] = resolve_model_path(cfg[key])
        key = f"{PREFIX}cuda_graph"
        checks = [lambda flag=flag: check_liger(cfg.get(flag), flag) for flag in LIGER_FLAGS]
        checks.append(lambda: check_cuda_graph(cfg.get(key), key, sharded=bool(cfg.get("fsdp_config"))))
        for check in checks:
            try:
                check()
            except FoRAInputError as error:
                # Before anything loads, and in one line: Liger's plugin would import its kernels after the model's
                # config is read and stop with a traceback, as would FoRA's config check (Axolotl prints a traceback
                # for every config it refuses).
                raise SystemExit(str(error)) from None
        if cfg.get(f"{PREFIX}mode") != "lora":
            for kernel in LORA_KERNELS:
                if cfg.get(kernel) is None:  # else Axolotl turns them on, and they drop the base-weight gradients
                    cfg[kernel] = False

    def post_trainer_create(self, cfg: DictDefault, trainer: Trainer) -> None:
        if not fora_enabled(cfg):
            return
        fora = fora_config_from(cfg)
        model = trainer.model
        if fora.mode == "lora":
            if isinstance(model, PeftModel):
                set_input_cast(model, fora.input_cast)  # Axolotl's LoRA, the same numbers with one copy less
            return
        if not isinstance(model, PeftModel):
            raise FoRAInputTypeError(
                f"FoRA expected Axolotl's trainer to hold the LoRA PeftModel (adapter: lora), but it holds a "
                f"{type(model).__name__}."
            )
        config = active_lora_config(model)
        checkpoint = determine_last_checkpoint(cfg)  # what Axolotl resumes from: its selection is reused
        if checkpoint is not None:
            check_checkpoint_files(checkpoint)
        # Axolotl's offloading checkpoints ("offload", "offload_disk") replace torch's checkpoint with reentrant
        # autograd Functions, whatever gradient_checkpointing_kwargs say.
        offloading = isinstance(cfg.gradient_checkpointing, str)
        autocast = cfg.peft_autocast_adapter_dtype if cfg.peft_autocast_adapter_dtype is not None else True
        training = prepare_fora_training(
            trainer,
            fora,
            score=lambda: score_on_trainer(trainer, model, fora, config),  # adapters disabled: the base is scored
            checkpoint=checkpoint,
            resume_checkpoint=lambda: checkpoint,
            fsdp2=bool(cfg.get("fsdp_config")),  # Axolotl 0.21 runs FSDP2 only: row-sharded lora_B (fsdp.py)
            autocast_adapter_dtype=autocast,
            reentrant=True if offloading else None,
        )
        _use_fora_optimizer(trainer, fora)
        _add_fora_logs(trainer, training.logs)


def _use_fora_optimizer(trainer: Trainer, fora: FoRAConfig) -> None:
    # An optimizer factory is how transformers and Axolotl take an optimizer that needs the whole model (as Muon
    # does): Axolotl calls factory()(model, training_args), transformers factory()(model).
    def factory():
        return lambda model, *_: fora_optimizer(trainer, model, fora)

    trainer.optimizer_cls_and_kwargs = (factory, {})


def _add_fora_logs(trainer: Trainer, fora_logs: FoRALogs) -> None:
    # FoRASFTTrainer.log does the same; a TrainerCallback's on_log comes after the log is recorded and reported.
    log = trainer.log

    @functools.wraps(log)
    def log_with_fora(logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(fora_logs(trainer.model, trainer.optimizer))
        return log(logs, start_time)

    trainer.log = log_with_fora


class _ShortPluginName(logging.Filter):
    """Stops the run with the fix when Axolotl cannot load ``plugins: [fora]``.

    Axolotl 0.21 loads a listed plugin by its dotted path only (``module.Class`` or ``module:Class``): the entry point
    name of this package, which a user may well write, fails inside its loader ("not enough values to unpack", with
    a traceback) before any plugin hook sees the config. Axolotl logs that failure on its plugin logger just before
    it re-raises; this filter on that logger is the one place FoRA's code runs then. (Axolotl imports this module
    earlier, when it registers the installed entry points.)
    """

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Could not load required plugin '%s'" and record.args and record.args[0] in self.names:
            raise SystemExit(
                f"plugins: [{record.args[0]}] cannot be loaded: Axolotl 0.21 loads plugins by their dotted path. "
                f"Write plugins: [{PLUGIN_NAME}]."
            )
        return True


_ENTRY_POINT = f"{FoRAPlugin.__module__}:{FoRAPlugin.__name__}"
logging.getLogger("axolotl.integrations.base").addFilter(
    _ShortPluginName(
        {point.name for point in entry_points(group=PLUGIN_ENTRY_POINT_GROUP) if point.value == _ENTRY_POINT}
    )
)
