"""Evaluation against direct computations and real model outputs."""

import math

import pytest
import torch
from conftest import char_tokenizer, tiny_llama

from fora_plugin.evaluation import (
    commonsense_accuracy,
    extract_answer,
    lm_eval_command,
    mt_bench_answers,
    perplexity,
)


# Generations as models write them after the commonsense prompts (LLM-Adapters' format and its failure modes).
GENERATIONS = [
    ("boolq", "the correct answer is false", "false"),
    ("boolq", "the correct answer is true\n\n### Instruction:\nPlease answer", "true"),
    ("boolq", "The correct answer is True.", ""),  # the protocol is case-sensitive: a miss
    ("boolq", "false, because the passage says true things", "false"),  # the first answer word counts
    ("ARC-Easy", "the correct answer is answer3", "answer3"),
    ("ARC-Challenge", "Answer2: Planetary years will become longer.", ""),  # capitalised: a miss
    ("openbookqa", "answer4 answer1", "answer4"),
    ("openbookqa", "The answer is 2", ""),
    ("piqa", "the correct answer is solution2", "solution2"),
    ("winogrande", "the correct answer is option1", "option1"),
    ("hellaswag", "the correct answer is ending4", "ending4"),
    ("social_i_qa", "the correct answer is answer3", "answer3"),
    ("social_i_qa", "the correct answer is answer5", "answer5"),  # LLM-Adapters puts some answers there
    ("boolq", "", ""),
]


@pytest.mark.parametrize(("task", "text", "expected"), GENERATIONS)
def test_answer_extraction(task, text, expected):
    assert extract_answer(task, text) == expected


def test_unknown_task_is_refused_by_name():
    with pytest.raises(ValueError, match=r"task='mmlu' has no answer format"):
        extract_answer("mmlu", "answer1")


def direct_nll(model, ids, start, t):
    """-log p(ids[t] | ids[start:t]) with one forward of exactly that context."""
    logits = model(input_ids=ids[start:t].unsqueeze(0)).logits[0, -1]
    return -torch.log_softmax(logits.double(), dim=-1)[ids[t]].item()


@pytest.mark.parametrize(("max_length", "stride"), [(64, 64), (24, 8), (16, 16)])
def test_perplexity_is_exp_of_the_directly_computed_mean_nll(max_length, stride):
    model, tokenizer = tiny_llama(vocab_size=99), char_tokenizer()
    text = "the quick brown fox jumps over the lazy dog; " * 2
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    nlls, previous_end = [], 0
    with torch.no_grad():
        for start in range(0, len(ids), stride):
            end = min(start + max_length, len(ids))
            for t in range(max(previous_end, start + 1), end):
                nlls.append(direct_nll(model, ids, start, t))
            previous_end = end
            if end == len(ids):
                break
    result = perplexity(model, tokenizer, text, max_length=max_length, stride=stride, progress=False)
    assert result["tokens"] == len(nlls)
    assert result["perplexity"] == pytest.approx(math.exp(sum(nlls) / len(nlls)), rel=1e-5)


def test_perplexity_refuses_a_bad_stride():
    with pytest.raises(ValueError, match=r"stride=0 must be in 1..max_length=8"):
        perplexity(tiny_llama(vocab_size=99), char_tokenizer(), "abc", max_length=8, stride=0)


def test_commonsense_accuracy_compares_extracted_answers():
    model, tokenizer = tiny_llama(vocab_size=99), char_tokenizer()
    examples = [{"instruction": "Is water wet?\n\nAnswer format: true/false", "answer": "true"}] * 3
    result = commonsense_accuracy(model, tokenizer, examples, "boolq", max_new_tokens=4, progress=False)
    # A random model writes random characters: no answer word, so three misses and accuracy 0.
    assert (result["total"], result["correct"], result["misses"], result["accuracy"]) == (3, 0, 3, 0.0)
    assert len(result["samples"]) == 3 and all(s["prediction"] == "" for s in result["samples"])


def test_mt_bench_answers_follow_fastchats_answer_schema():
    model, tokenizer = tiny_llama(vocab_size=99), char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    questions = [
        {"question_id": 81, "category": "writing", "turns": ["Hi.", "Again."]},
        {"question_id": 82, "category": "math", "turns": ["1+1?", "2+2?"]},
    ]
    records = mt_bench_answers(model, tokenizer, questions, "tiny-fora", max_new_tokens=3, progress=False)
    for record, question in zip(records, questions):
        # FastChat's load_model_answers / gen_judgment read exactly these fields and types.
        assert set(record) == {"question_id", "answer_id", "model_id", "choices", "tstamp"}
        assert record["question_id"] == question["question_id"] and record["model_id"] == "tiny-fora"
        assert isinstance(record["answer_id"], str) and isinstance(record["tstamp"], float)
        (choice,) = record["choices"]
        assert choice["index"] == 0 and len(choice["turns"]) == 2
        assert all(isinstance(turn, str) for turn in choice["turns"])
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"no chat_template"):
        mt_bench_answers(model, tokenizer, questions, "x")


def test_lm_eval_command_loads_the_adapter_as_plain_peft():
    command = lm_eval_command("google/gemma-3-270m", "outputs/quickstart", ["arc_easy", "boolq"])
    assert command == (
        "lm_eval --model hf --model_args pretrained=google/gemma-3-270m,peft=outputs/quickstart "
        "--tasks arc_easy,boolq --batch_size 8"
    )
