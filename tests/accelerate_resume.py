"""A custom training loop on Accelerate, checkpointed with ``save_state`` and resumed with ``load_state`` in another
process: the way Accelerate users checkpoint, which keeps one tensor of any group that shares storage.

    python tests/accelerate_resume.py run OUT        # 6 steps, save_state after step 3, the final adapter
    python tests/accelerate_resume.py resume OUT     # load_state from OUT's checkpoint, steps 4 to 6, the adapter

tests/test_optim.py runs both and compares the two adapters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest's tiny models, as the tests use them

from accelerate import Accelerator  # noqa: E402
from conftest import TARGETS, tiny_llama  # noqa: E402
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict  # noqa: E402

from fora_plugin import build_fora_optimizer, make_stiefel  # noqa: E402


STEPS, SAVED_AT = 6, 3


def batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": ids}


def main(mode: str, out: Path) -> None:
    accelerator = Accelerator(cpu=True)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, layers_to_transform=[1, 3])
    model = get_peft_model(tiny_llama(num_layers=4).train(), config)
    make_stiefel(model, generator=torch.Generator().manual_seed(0))
    optimizer = build_fora_optimizer(model, lr=1e-2, lr_stiefel=5e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    first = 0
    if mode == "resume":
        accelerator.load_state(out / "checkpoint")
        first = SAVED_AT
    for step in range(first, STEPS):
        accelerator.backward(model(**batch(step)).loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if mode == "run" and step + 1 == SAVED_AT:
            accelerator.save_state(out / "checkpoint")
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(accelerator.unwrap_model(model)).items()}
    torch.save(adapter, out / f"{mode}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
