"""MT-Bench scored end to end: answers, an LLM judge behind any OpenAI-compatible endpoint, FastChat's files.

Modules, in import order: ``config`` (MTBenchConfig, its checks and ``fora eval`` flags), ``questions`` (questions,
answers, references, judge prompts), ``cache`` (the fsynced JSONL append), ``client`` (the judge server, with
retries), ``judge`` (prompts, parsing, one loop for single and pairwise: :func:`judge_all`), ``results`` (means,
table, plot), ``answers`` (the model's answers), ``pipeline`` (prepare, run, score). ``openai`` is imported only when
a judge is made.

May import: mt_bench.
"""

from __future__ import annotations

# Each module's __all__ is the one list of what it offers; the package offers the union.
from .answers import *  # noqa: F403
from .answers import __all__ as _answers_names
from .cache import *  # noqa: F403
from .cache import __all__ as _cache_names
from .client import *  # noqa: F403
from .client import __all__ as _client_names
from .config import *  # noqa: F403
from .config import __all__ as _config_names
from .judge import *  # noqa: F403
from .judge import __all__ as _judge_names
from .pipeline import *  # noqa: F403
from .pipeline import __all__ as _pipeline_names
from .questions import *  # noqa: F403
from .questions import __all__ as _questions_names
from .results import *  # noqa: F403
from .results import __all__ as _results_names


__all__: list[str] = [
    *_config_names,
    *_questions_names,
    *_cache_names,
    *_client_names,
    *_judge_names,
    *_results_names,
    *_answers_names,
    *_pipeline_names,
]
