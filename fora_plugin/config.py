"""FoRAConfig: where to adapt and how, validated up front; and its ``fora_``-prefixed form for YAML configs.

May import: adapter, errors, fisher, optim, selection, stiefel, validation.
"""

# No `from __future__ import annotations`: HfArgumentParser reads these field types at run time.
import dataclasses
from dataclasses import dataclass, field

from .adapter import INIT_A
from .errors import FoRAInputError, refuse
from .fisher import FISHER_PARAMS
from .optim import check_cayley_adam_settings
from .selection import LAYER_STRATEGIES, SCORES_FILE, check_layer_list, parse_layer_budget
from .stiefel import CAYLEY_SOLVERS
from .validation import check_choice, check_float, check_int


__all__ = [
    "ADAPTER_DTYPES",
    "INPUT_CASTS",
    "MODES",
    "MODE_PARTS",
    "PREFIX",
    "FoRAArguments",
    "FoRAConfig",
]


MODES = ("fora", "fg-lora", "stiefel-lora", "lora")
# mode -> (Fisher-selected layers, Stiefel lora_B): the paper's 2x2 ablation.
MODE_PARTS = {"fora": (True, True), "fg-lora": (True, False), "stiefel-lora": (False, True), "lora": (False, False)}
# How a LoRA layer's input meets its weights: "auto" skips PEFT's cast where autocast casts anyway, "peft" keeps it.
INPUT_CASTS = ("auto", "peft")
# The adapters' dtype: "auto" as the trainer makes them, "bfloat16" with fp32 masters in FoRA's optimizer.
ADAPTER_DTYPES = ("auto", "bfloat16")


@dataclass
class FoRAConfig:
    """Configuration of FoRA: Fisher-selected layers and Stiefel-constrained ``lora_B``.

    The LoRA itself (rank, alpha, target modules, dropout) comes from a normal ``peft.LoraConfig``.
    """

    mode: str = field(
        default="fora",
        metadata={
            "help": "'fora': Fisher-selected layers + Stiefel lora_B (the method). The paper's ablation: 'fg-lora' "
            "(Fisher-selected layers, plain LoRA: PEFT's init, AdamW on A and B), 'stiefel-lora' (all layers, "
            "Stiefel lora_B), 'lora' (all layers, plain LoRA: exactly TRL's SFTTrainer with the LoraConfig).",
            "choices": MODES,
        },
    )
    layer_budget: float | int | str = field(
        default=0.5,
        metadata={
            "help": "K, the number of layers to adapt: a float in (0, 1] is a fraction of the L decoder layers "
            "(0.5 = the paper's K = L/2; 1.0 = all), an int is K itself. Ignored when `layers` is given."
        },
    )
    layers: list[int] | None = field(
        default=None,
        metadata={"help": "Explicit decoder-layer indices to adapt (0-based); skips Fisher scoring."},
    )
    layer_strategy: str = field(
        default="fisher",
        metadata={
            "help": "How to pick the K layers: 'fisher' (top-K Fisher scores, ties to the lower index), or the "
            "paper's controls 'random' (seeded by `seed`), 'first', 'last'.",
            "choices": LAYER_STRATEGIES,
        },
    )
    fisher_batches: int = field(
        default=128,
        metadata={"help": "N, the number of training mini-batches the Fisher score averages over (paper: 128)."},
    )
    fisher_params: str = field(
        default="layer",
        metadata={
            "help": "Which base parameters a layer's score sums over: 'layer' (all of the decoder layer, the "
            "paper's definition) or 'targets' (only the LoRA target linears).",
            "choices": FISHER_PARAMS,
        },
    )
    lr_stiefel: float = field(
        default=1e-3,
        metadata={"help": "Learning rate of Cayley-Adam on lora_B (paper: 1e-3, against 2e-4 for lora_A)."},
    )
    stiefel_beta1: float = field(
        default=0.9,
        metadata={
            "help": "Cayley-Adam's decay of the first moment of lora_B's gradient, in [0, 1) (paper's code: 0.9)."
        },
    )
    stiefel_beta2: float = field(
        default=0.99,
        metadata={
            "help": "Cayley-Adam's decay of the scalar second moment ‖G‖² of lora_B's gradient, in [0, 1) "
            "(paper's code: 0.99)."
        },
    )
    stiefel_eps: float = field(
        default=1e-8,
        metadata={"help": "Cayley-Adam's ε added to √v̂, >= 0 (paper's code: 1e-8)."},
    )
    qr_period: int = field(
        default=200,
        metadata={"help": "Re-project every lora_B onto the manifold by QR every this many steps; 0 = never."},
    )
    cayley_solver: str = field(
        default="exact",
        metadata={
            "help": "'exact': the Woodbury Cayley step (one 2r x 2r solve); 'fixed_point': the paper's "
            "fixed-point iteration (`cayley_iters` steps), to reproduce its numbers.",
            "choices": CAYLEY_SOLVERS,
        },
    )
    cayley_iters: int = field(
        default=5,
        metadata={"help": "Iterations of the fixed-point Cayley solver (paper: 5)."},
    )
    cuda_graph: bool | None = field(
        default=None,
        metadata={
            "help": "Capture Cayley-Adam's step in a CUDA graph after two eager steps and replay it (one launch "
            "instead of one per kernel). Unset: captured where lora_B can be in a process started without a launcher "
            "(one CUDA GPU); eager on the CPU, under FSDP2 and, until measured there, under torchrun / accelerate "
            "launch (DDP, even with one process) and DeepSpeed. true: captured, refused where it cannot be. false: "
            "eager."
        },
    )
    init_a: str = field(
        default="zeros",
        metadata={
            "help": "Initial lora_A of a Stiefel adapter: 'zeros' (ΔW = BA = 0 at step 0, the model starts as the "
            "base) or 'gaussian' (the paper's N(0, 1/r): ΔW != 0 at step 0).",
            "choices": INIT_A,
        },
    )
    scores_path: str | None = field(
        default=None,
        metadata={"help": f"A {SCORES_FILE} from an earlier run to reuse instead of scoring again."},
    )
    seed: int | None = field(
        default=None,
        metadata={"help": "Seed of the random layer strategy and the Stiefel init; None = the training seed."},
    )
    input_cast: str = field(
        default="auto",
        metadata={
            "help": "'auto': in a forward under bf16/fp16 autocast, PEFT's cast of each LoRA layer's input to the "
            "adapters' fp32 is skipped (the autocast casts both operands of the adapter's matmul anyway: the same "
            "numbers, one copy of every LoRA input less in time and memory); without autocast PEFT casts as usual. "
            "'peft': PEFT's cast always.",
            "choices": INPUT_CASTS,
        },
    )
    adapter_dtype: str = field(
        default="auto",
        metadata={
            "help": "'auto': the adapters get the dtype the trainer gives them (PEFT's fp32 over a bf16/fp16 base; "
            "the base's dtype under DeepSpeed ZeRO-3; bf16 on a 4-bit base). 'bfloat16': lora_A and lora_B are "
            "bf16 in the forward and backward, and FoRA's optimizer keeps an fp32 master and fp32 moments of each "
            "(not with mode 'lora', whose optimizer is the Trainer's).",
            "choices": ADAPTER_DTYPES,
        },
    )

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES)
        check_choice("layer_strategy", self.layer_strategy, LAYER_STRATEGIES)
        check_choice("fisher_params", self.fisher_params, FISHER_PARAMS)
        check_choice("init_a", self.init_a, INIT_A)
        check_choice("input_cast", self.input_cast, INPUT_CASTS)
        check_choice("adapter_dtype", self.adapter_dtype, ADAPTER_DTYPES)
        if self.adapter_dtype == "bfloat16" and self.mode == "lora":
            raise FoRAInputError(
                "adapter_dtype='bfloat16' contradicts mode='lora': that mode trains with the Trainer's own AdamW, "
                "which would keep bf16 weights and moments without an fp32 master. Use mode 'fora', 'fg-lora' or "
                "'stiefel-lora' (FoRA's optimizer keeps the masters), or adapter_dtype='auto'."
            )
        self.layer_budget = parse_layer_budget(self.layer_budget)
        check_int("fisher_batches", self.fisher_batches, 1, "the paper uses 128")
        check_float("lr_stiefel", self.lr_stiefel, lambda x: x > 0, "a finite float > 0 (the paper uses 1e-3)")
        check_cayley_adam_settings(  # the optimizer's own rule, refused in FoRAConfig's names
            betas=(self.stiefel_beta1, self.stiefel_beta2),
            eps=self.stiefel_eps,
            qr_period=self.qr_period,
            cayley_solver=self.cayley_solver,
            cayley_iters=self.cayley_iters,
            keys={"betas": ("stiefel_beta1", "stiefel_beta2"), "eps": "stiefel_eps"},
            error=FoRAInputError,
        )
        if not (self.cuda_graph is None or isinstance(self.cuda_graph, bool)):  # 0 would pass `in (None, True, False)`
            refuse("cuda_graph", self.cuda_graph, "use true or false, or leave it unset (captured where it can be)")
        if self.seed is not None:
            check_int("seed", self.seed, 0, "or None for the training seed")
        if self.layers is not None:
            self.layers = check_layer_list(self.layers)
            if not self.selects_layers:
                raise FoRAInputError(
                    f"layers={self.layers} contradicts mode={self.mode!r}, which adapts every layer: "
                    "use mode 'fora' or 'fg-lora' with explicit layers."
                )
            if self.scores_path is not None:
                raise FoRAInputError("layers and scores_path are both set: explicit layers skip scoring, so drop one.")
        # Settings of how the layers are chosen that another setting would make ignored.
        strategy = self.layer_strategy if self.layer_strategy != "fisher" else None
        for name, value in (("layers", self.layers), ("scores_path", self.scores_path)):
            if value is not None and strategy is not None:
                refuse(
                    "layer_strategy",
                    strategy,
                    f"{name}={value!r} is set too, and the {strategy!r} strategy chooses the layers itself",
                    f"Drop {name} or layer_strategy.",
                )
        for name, value in (("layer_strategy", strategy), ("scores_path", self.scores_path)):
            if value is not None and not self.selects_layers:
                refuse(
                    name,
                    value,
                    f"mode={self.mode!r} adapts every layer, so it would be ignored",
                    f"Drop {name}, or use mode 'fora' or 'fg-lora'.",
                )

    @property
    def selects_layers(self) -> bool:
        """Whether this mode adapts a selection of layers (else: every layer)."""
        return MODE_PARTS[self.mode][0]

    @property
    def uses_stiefel(self) -> bool:
        """Whether this mode makes lora_B Stiefel-constrained."""
        return MODE_PARTS[self.mode][1]


PREFIX = "fora_"


def _arguments_class() -> type:
    # The same fields with a `fora_` prefix, for TrlParser/HfArgumentParser next to SFTConfig (whose `seed` would
    # clash) and for YAML keys that read the same in `fora train` configs and Axolotl configs.
    specs = []
    for f in dataclasses.fields(FoRAConfig):
        annotation = str if f.name == "layer_budget" else f.type
        default = str(f.default) if f.name == "layer_budget" else f.default
        specs.append((PREFIX + f.name, annotation, field(default=default, metadata=dict(f.metadata))))

    def to_fora_config(self) -> FoRAConfig:
        return FoRAConfig(**{f.name[len(PREFIX) :]: getattr(self, f.name) for f in dataclasses.fields(self)})

    return dataclasses.make_dataclass(
        "FoRAArguments",
        specs,
        namespace={
            "to_fora_config": to_fora_config,
            "__module__": __name__,
            "__doc__": "FoRAConfig's fields with a `fora_` prefix, for YAML/command-line parsing.",
        },
    )


FoRAArguments = _arguments_class()
