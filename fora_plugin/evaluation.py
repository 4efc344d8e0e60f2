"""Evaluation for the paper's use: commonsense accuracy, WikiText-2 perplexity, MT-Bench answers.

May import: data, errors.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .data import ALPACA_PROMPT_NO_INPUT
from .errors import FoRAInputError, refuse


__all__ = [
    "ANSWER_PATTERNS",
    "check_commonsense_examples",
    "commonsense_accuracy",
    "commonsense_prompt",
    "completion_loss",
    "eval_mode",
    "extract_answer",
    "generate",
    "lm_eval_command",
    "mt_bench_answers",
    "mt_bench_judge_command",
    "perplexity",
    "write_jsonl",
]


# The answer words of each LLM-Adapters task, as its evaluation script reads them.
ANSWER_PATTERNS = {
    "boolq": r"true|false",
    "piqa": r"solution1|solution2",
    "social_i_qa": r"answer1|answer2|answer3|answer4|answer5",
    "ARC-Challenge": r"answer1|answer2|answer3|answer4|answer5",
    "ARC-Easy": r"answer1|answer2|answer3|answer4|answer5",
    "openbookqa": r"answer1|answer2|answer3|answer4|answer5",
    "hellaswag": r"ending1|ending2|ending3|ending4",
    "winogrande": r"option1|option2",
}


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Evaluate without dropout, then give the model back in the mode it came in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def extract_answer(task: str, text: str) -> str:
    """The first answer word of ``task``'s kind in a generated ``text``; ``""`` when there is none (a miss)."""
    if task not in ANSWER_PATTERNS:
        raise FoRAInputError(f"task={task!r} has no answer format; known tasks: {sorted(ANSWER_PATTERNS)}.")
    found = re.findall(ANSWER_PATTERNS[task], text.strip())
    return found[0] if found else ""


def check_commonsense_examples(
    task: str, examples: Any, where: str, fields: Sequence[str] = ("instruction", "answer")
) -> list[dict[str, Any]]:
    """Refuse, before the model loads, a task whose answers cannot be read (no answer format for its name) or whose
    examples are not a list of mappings with a string in each of ``fields`` (LLM-Adapters' ``instruction`` and
    ``answer``; ``output`` for a held-out loss). Returns the examples."""
    if task not in ANSWER_PATTERNS:
        refuse(
            "task",
            task,
            f"there is no answer format for it (the answer words are read by task name: {sorted(ANSWER_PATTERNS)})",
            "Name the task's folder as LLM-Adapters does (e.g. boolq, ARC-Easy).",
        )
    if not isinstance(examples, list) or not examples:
        raise FoRAInputError(
            f"{where} holds a JSON {type(examples).__name__} with no examples: give a list of examples, as "
            "LLM-Adapters' dataset files do."
        )
    for index, example in enumerate(examples):
        missing = [f for f in fields if not (isinstance(example, dict) and isinstance(example.get(f), str))]
        if missing:
            found = sorted(example) if isinstance(example, dict) else type(example).__name__
            raise FoRAInputError(
                f"{where}: example {index} has no string {missing[0]!r} (it holds {found}), which the evaluation "
                f"reads. Give every example {', '.join(map(repr, fields))}, as LLM-Adapters' files do."
            )
    return examples


def commonsense_prompt(instruction: str) -> str:
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    progress: bool = True,
    desc: str = "generating",
) -> list[str]:
    """Greedy continuations of ``prompts`` (only the new text), batched with left padding."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = next(model.parameters()).device
    outputs: list[str] = []
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # decoder-only: pad where generation does not go
    try:
        with eval_mode(model):
            for start in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=not progress):
                batch = tokenizer(list(prompts[start : start + batch_size]), return_tensors="pt", padding=True)
                batch = {k: v.to(device) for k, v in batch.items()}
                generated = model.generate(
                    **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
                new_tokens = generated[:, batch["input_ids"].shape[1] :]
                outputs.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = side
    return outputs


def commonsense_accuracy(
    model: nn.Module,
    tokenizer,
    examples: Sequence[dict[str, Any]],
    task: str,
    *,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    progress: bool = True,
) -> dict[str, Any]:
    """Accuracy of greedy answers on LLM-Adapters examples (``instruction`` and ``answer`` fields).

    Commonsense accuracy follows the LLM-Adapters protocol the paper uses: greedy generation after the Alpaca prompt,
    the first answer word of the task's kind (``true``/``false``, ``answer1``..``answer5``, ``solution1/2``,
    ``option1/2``, ``ending1..4``) read out of the generated text, case-sensitively as in that protocol, and compared
    with the example's ``answer``.
    """
    prompts = [commonsense_prompt(e["instruction"]) for e in examples]
    texts = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        progress=progress,
        desc=f"{task}",
    )
    predictions = [extract_answer(task, t) for t in texts]
    correct = sum(p == e["answer"] for p, e in zip(predictions, examples))
    return {
        "task": task,
        "accuracy": correct / len(examples) if examples else 0.0,
        "correct": correct,
        "total": len(examples),
        "misses": sum(p == "" for p in predictions),
        "samples": [
            {"generation": t, "prediction": p, "answer": e["answer"]}
            for t, p, e in list(zip(texts, predictions, examples))[:5]
        ],
    }


@torch.no_grad()
def perplexity(
    model: nn.Module,
    tokenizer,
    text: str,
    *,
    max_length: int = 1024,
    stride: int = 512,
    max_tokens: int | None = None,
    progress: bool = True,
    name: str = "the text",
) -> dict[str, float]:
    """Perplexity exp(mean NLL) of ``text`` over strided windows; ``max_tokens`` caps the tokens scored. ``name``
    says where the text comes from (a flag and its file), for the message when it is too short.

    Perplexity uses strided windows over the raw text: each token is predicted once, with up to
    ``max_length − stride`` tokens of context from the window before.
    """
    if not 0 < stride <= max_length:
        raise FoRAInputError(f"stride={stride} must be in 1..max_length={max_length}.")
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ids.numel() < 2:
        raise FoRAInputError(
            f"{name} holds {ids.numel()} token(s){f' (max_tokens={max_tokens})' if max_tokens is not None else ''}: "
            "perplexity needs at least 2 (each token is predicted from those before it). Give a longer text."
        )
    device = next(model.parameters()).device
    nll_sum, counted, previous_end = 0.0, 0, 0
    starts = range(0, ids.numel(), stride)
    with eval_mode(model):
        for start in tqdm(starts, desc="perplexity", disable=not progress):
            end = min(start + max_length, ids.numel())
            window = ids[start:end].unsqueeze(0).to(device)
            labels = window.clone()
            labels[:, : max(0, previous_end - start)] = -100  # tokens already scored are context only
            logits = model(input_ids=window).logits[:, :-1].float()
            targets = labels[:, 1:]
            losses = nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
            )
            nll_sum += losses.item()
            counted += int((targets != -100).sum())
            previous_end = end
            if end == ids.numel():
                break
    mean_nll = nll_sum / counted
    return {"perplexity": math.exp(mean_nll), "mean_nll": mean_nll, "tokens": counted}


def mt_bench_answers(
    model: nn.Module,
    tokenizer,
    questions: Sequence[dict[str, Any]],
    model_id: str,
    *,
    max_new_tokens: int = 1024,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Two-turn answers to MT-Bench questions, as FastChat ``model_answer`` records.

    MT-Bench: two-turn answers with the model's chat template, written in FastChat's ``model_answer`` JSONL format,
    to be judged by FastChat's ``gen_judgment`` (the judge needs the user's API key; nothing here calls an API).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise FoRAInputError(
            "MT-Bench needs a chat model: the tokenizer has no chat_template. Set one (e.g. from the "
            "instruct variant of the model) or evaluate an instruction-tuned checkpoint."
        )
    records = []
    for question in tqdm(questions, desc="MT-Bench", disable=not progress):
        messages, turns = [], []
        for turn in question["turns"]:
            messages.append({"role": "user", "content": turn})
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            (answer,) = generate(
                model, tokenizer, [prompt], max_new_tokens=max_new_tokens, batch_size=1, progress=False
            )
            answer = answer.strip()
            messages.append({"role": "assistant", "content": answer})
            turns.append(answer)
        records.append(
            {
                "question_id": question["question_id"],
                "answer_id": uuid.uuid4().hex,
                "model_id": model_id,
                "choices": [{"index": 0, "turns": turns}],
                "tstamp": time.time(),
            }
        )
    return records


def write_jsonl(path: str | Path, records: Sequence[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def mt_bench_judge_command(model_id: str) -> str:
    """What to run, in a FastChat checkout with OPENAI_API_KEY set, to judge the answers with GPT-4."""
    return (
        f"cp model_answer/{model_id}.jsonl fastchat/llm_judge/data/mt_bench/model_answer/ && cd fastchat/llm_judge && "
        f"python gen_judgment.py --model-list {model_id} --parallel 2 && python show_result.py --model-list {model_id}"
    )


def lm_eval_command(base: str, adapter: str | None, tasks: Sequence[str]) -> str:
    """The lm-evaluation-harness command for the same model: FoRA adapters are plain PEFT LoRA."""
    model_args = f"pretrained={base}" + (f",peft={adapter}" if adapter else "")
    return f"lm_eval --model hf --model_args {model_args} --tasks {','.join(tasks)} --batch_size 8"


@torch.no_grad()
def completion_loss(
    model: nn.Module, tokenizer, examples: Sequence[dict[str, Any]], *, progress: bool = True
) -> float:
    """Mean per-token NLL of held-out completions (``output``) after their Alpaca prompts (``instruction``)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with eval_mode(model):
        for example in tqdm(examples, desc="eval loss", disable=not progress):
            prompt = tokenizer(commonsense_prompt(example["instruction"])).input_ids
            completion = tokenizer(example["output"] + (tokenizer.eos_token or ""), add_special_tokens=False).input_ids
            ids = torch.tensor([prompt + completion], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # predictions of the completion
            total += nn.functional.cross_entropy(logits, ids[0, len(prompt) :], reduction="sum").item()
            count += len(completion)
    return total / count
