"""MT-Bench judged end to end against a real OpenAI-compatible server (``transformers serve``) on localhost.

The judge is a real ``LlamaForCausalLM`` served by ``transformers serve`` and answering over HTTP through the
``openai`` client. Its weights are set so that greedy decoding is a lookup (the attention and MLP outputs are zero,
so the last prompt token alone picks the reply), and its chat template ends each prompt with a token chosen from the
prompt's content. So the judge's replies are known in advance, as a brute-force reference for the scores:

- single-answer, turn 1: ``[7]`` (FastChat's fallback ``[rating]`` form) -> 7;
- single-answer, turn 2: ``Rating: [[4]]`` -> 4;
- any prompt with a reference answer (math, reasoning, coding): ``N/A`` -> no rating -> -1, counted;
- pairwise: ``[[A]]`` or ``[[B]]``, whichever is not the answer containing ``I refuse.``.

Requests are counted on the server's side, in its access log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import TARGETS, char_tokenizer, tiny_llama

from fora_plugin import mt_bench
from fora_plugin.cli import main
from fora_plugin.mt_bench import (
    BUNDLED_QUESTIONS,
    MTBenchConfig,
    load_questions,
    pairwise_summary,
    parse_rating,
    parse_verdict,
    single_summary,
)


# Single-token replies of the judge, and the character that ends the prompt for each kind of judgment.
REPLIES = {":": "[7]", "#": "Rating: [[4]]", "?": "N/A", "=": "[[A]]", "%": "[[B]]"}
JUDGE_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}"
    "{% set c = messages[-1]['content'] %}"
    "{% if 'Reference Answer' in c or 'Reference answer' in c %} verdict?"
    "{% elif 'Assistant B' in c %}{% if 'I refuse.' in c.split('Assistant B')[0] %} verdict%"
    "{% else %} verdict={% endif %}"
    "{% elif 'Conversation with User' in c %} verdict#"
    "{% else %} verdict:{% endif %}{% endif %}"
)
FASTCHAT_SINGLE_FIELDS = {"question_id", "model", "judge", "user_prompt", "judgment", "score", "turn", "tstamp"}
FASTCHAT_PAIR_FIELDS = {
    "question_id",
    "model_1",
    "model_2",
    "g1_winner",
    "g2_winner",
    "judge",
    "g1_user_prompt",
    "g1_judgment",
    "g2_user_prompt",
    "g2_judgment",
    "turn",
    "tstamp",
}
# Two general questions and one graded against a reference (FastChat's question ids).
QUESTION_IDS = (81, 82, 111)
SECRET = "sk-test-never-written-0123456789"


def build_judge(folder: Path) -> Path:
    """A real Llama checkpoint whose greedy reply to any prompt is REPLIES[last character of the prompt]."""
    from tokenizers import decoders
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer()
    tokenizer.add_tokens(sorted(set(REPLIES.values())))
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # characters join without spaces
    tokenizer.chat_template = JUDGE_TEMPLATE
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=16384,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in [model.model.norm] + [n for layer in model.model.layers for n in (layer.input_layernorm,)]:
            norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.fill_(1.0)
        # Zero attention/MLP outputs: the final hidden state is the current token's one-hot embedding, and lm_head
        # maps it to the next token, so greedy decoding follows this table.
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        for last, reply in REPLIES.items():
            reply_id = tokenizer.convert_tokens_to_ids(reply)
            model.lm_head.weight[reply_id, tokenizer.convert_tokens_to_ids(last)] = 1.0
            model.lm_head.weight[tokenizer.eos_token_id, reply_id] = 1.0
    model.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=0, bos_token_id=1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``transformers serve`` pinned to one model, on a free localhost port; its access log counts requests."""

    def __init__(self, model: Path, log: Path):
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}/v1"
        cli = Path(sys.executable).with_name("transformers")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [str(cli), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu"]
        self.process = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while "Uvicorn running" not in log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"transformers serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def completions(self) -> int:
        """Chat completion requests the server has answered, read from its access log."""
        return len(re.findall(r'"POST /v1/chat/completions HTTP/1.1" 200', self.log.read_text()))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The judge checkpoint, a tiny chat model with a LoRA adapter, and three MT-Bench questions."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("mt_bench")
    build_judge(root / "judge")
    base, tokenizer = tiny_llama(2, vocab_size=99), char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    torch.manual_seed(0)
    adapter = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS, init_lora_weights=False))
    adapter.save_pretrained(root / "adapter")
    questions = [q for q in load_questions() if q["question_id"] in QUESTION_IDS]
    (root / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    return {"root": root, "judge": root / "judge", "base": root / "base", "adapter": root / "adapter"}


@pytest.fixture(autouse=True)
def judge_key(monkeypatch):
    """The key variable every judged run names (a local server ignores the key; it must still never be written)."""
    monkeypatch.setenv("FORA_TEST_JUDGE_KEY", SECRET)


@pytest.fixture(scope="module")
def server(files):
    server = Server(files["judge"], files["root"] / "server.log")
    yield server
    server.stop()


def eval_argv(files, out: Path, url: str, *extra: str) -> list[str]:
    return [
        "eval",
        "--base",
        str(files["base"]),
        "--adapter",
        str(files["adapter"]),
        "--output",
        str(out),
        "--model-id",
        "tiny-fora",
        "--mt-bench",
        str(files["root"] / "questions.jsonl"),
        "--mt-bench-max-new-tokens",
        "6",
        "--judge-model",
        str(files["judge"]),
        "--judge-base-url",
        url,
        "--judge-api-key-env",
        "FORA_TEST_JUDGE_KEY",
        "--judge-retry-wait",
        "0.05",
        *extra,
    ]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_one_error_line(stderr: str) -> None:
    """The refusal is one line (progress bars before it are fine), without a traceback."""
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("fora eval: error: ") and "Traceback" not in stderr, stderr


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------------------------------------- a real server
@pytest.mark.slow
def test_judged_end_to_end_with_fastchat_files_and_a_cache(files, server, tmp_path, capsys):
    out = tmp_path / "eval"
    code, stdout, stderr = run_cli(eval_argv(files, out, server.url), capsys)
    assert code == 0, stderr
    answers = read_jsonl(out / "model_answer" / "tiny-fora.jsonl")
    assert sorted(a["question_id"] for a in answers) == list(QUESTION_IDS)
    judgment_file = out / "model_judgment" / f"{MTBenchConfig(judge_model=str(files['judge'])).judge_file_name}"
    records = read_jsonl(Path(f"{judgment_file}_single.jsonl"))
    assert server.completions() == len(records) == 2 * len(QUESTION_IDS)
    categories = {q["question_id"]: q["category"] for q in load_questions(files["root"] / "questions.jsonl")}
    for r in records:
        assert set(r) == FASTCHAT_SINGLE_FIELDS and r["model"] == "tiny-fora"
        ref = categories[r["question_id"]] in mt_bench.NEED_REF_CATS
        expected_prompt = mt_bench.SINGLE_PROMPTS[ref, r["turn"] == 2]
        assert r["judge"] == [str(files["judge"]), expected_prompt]
        expected_reply = "N/A" if ref else {1: "[7]", 2: "Rating: [[4]]"}[r["turn"]]
        assert r["judgment"] == expected_reply
        assert r["score"] == (-1 if ref else {1: 7, 2: 4}[r["turn"]])
        answer = next(a for a in answers if a["question_id"] == r["question_id"])["choices"][0]["turns"]
        assert answer[r["turn"] - 1] in r["user_prompt"]
        if ref:
            assert "[The Start of Reference Answer]" in r["user_prompt"] or "Reference Answer|>" in r["user_prompt"]
    # The table, recomputed from the judgment file as FastChat's show_result.py does (drop -1, then mean).
    kept = [r for r in records if r["score"] != -1]
    results = json.loads((out / "results.json").read_text())["mt_bench"]["summary"]["tiny-fora"]
    assert results["score"] == pytest.approx(sum(r["score"] for r in kept) / len(kept)) == 5.5
    assert results["turn_1"] == 7 and results["turn_2"] == 4
    assert results["categories"] == {"writing": 5.5, "math": None}
    assert results["unparsable"] == 2 and results["judgments"] == 6 and results["judge"] == str(files["judge"])
    table = (out / "results.md").read_text()
    assert f"| tiny-fora | {files['judge']} | 5.50 | 7.00 | 4.00 | 5.50 | - | 6 | 2 |" in table
    assert (out / "mt_bench.png").stat().st_size > 10_000
    # The key is read from the variable, never written or printed.
    written = "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file() and p.suffix != ".png")
    assert SECRET not in written + stdout + stderr

    # A re-run asks the server for nothing: every judgment is in the file.
    before = server.completions()
    code, stdout, stderr = run_cli(eval_argv(files, out, server.url), capsys)
    assert code == 0, stderr
    assert server.completions() == before
    assert read_jsonl(Path(f"{judgment_file}_single.jsonl")) == records
    assert json.loads((out / "results.json").read_text())["mt_bench"]["summary"]["tiny-fora"] == results


@pytest.mark.slow
def test_pairwise_judges_both_orders_and_counts_wins(files, server, tmp_path, capsys):
    out = tmp_path / "eval"
    # A rival whose every answer is a refusal; the judge prefers the other answer in both orders.
    rival = out / "model_answer" / "refuser.jsonl"
    rival.parent.mkdir(parents=True)
    rival.write_text(
        "".join(
            json.dumps(
                {"question_id": q, "model_id": "refuser", "choices": [{"index": 0, "turns": ["I refuse."] * 2}]}
            )
            + "\n"
            for q in QUESTION_IDS
        )
    )
    before = server.completions()
    code, _, stderr = run_cli(
        eval_argv(
            files, out, server.url, "--mt-bench-compare", "refuser", "--mt-bench-pairwise", "--judge-parallel", "2"
        ),
        capsys,
    )
    assert code == 0, stderr
    pairs = read_jsonl(next((out / "model_judgment").glob("*_pair.jsonl")))
    assert len(pairs) == 2 * len(QUESTION_IDS)
    # Single grades of both models (12) and two orders per pairwise match (12).
    assert server.completions() - before == 12 + 2 * len(pairs)
    for p in pairs:
        assert set(p) == FASTCHAT_PAIR_FIELDS and (p["model_1"], p["model_2"]) == ("tiny-fora", "refuser")
        if categories_need_ref(files, p["question_id"]):
            assert (p["g1_winner"], p["g2_winner"]) == ("error", "error")
        else:
            # g1 shows tiny-fora as A ([[A]] wins), g2 shows it as B ([[B]] wins): both say model_1.
            assert (p["g1_judgment"], p["g2_judgment"]) == ("[[A]]", "[[B]]")
            assert (p["g1_winner"], p["g2_winner"]) == ("model_1", "model_1")
    summary = json.loads((out / "results.json").read_text())["mt_bench"]["pairwise"][0]
    assert (summary["win"], summary["tie"], summary["loss"], summary["error"]) == (4, 0, 0, 2)
    single = json.loads((out / "results.json").read_text())["mt_bench"]["summary"]
    assert list(single) == ["tiny-fora", "refuser"]
    assert "| tiny-fora | refuser |" in (out / "results.md").read_text()


def categories_need_ref(files, question_id: int) -> bool:
    questions = load_questions(files["root"] / "questions.jsonl")
    return next(q for q in questions if q["question_id"] == question_id)["category"] in mt_bench.NEED_REF_CATS


@pytest.mark.slow
def test_a_server_that_dies_mid_run_keeps_judgments_and_a_rerun_resumes(files, server, tmp_path, capsys):
    out = tmp_path / "eval"
    dying = Server(files["judge"], tmp_path / "dying.log")

    def kill_after_two():
        while dying.completions() < 2 and dying.process.poll() is None:
            time.sleep(0.005)
        # The second reply is served before the client has written its judgment: under load, a stop at once could
        # lose it in flight and leave one. Wait (5 s at most) until two are on disk, so the count below is exact.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            written = list((out / "model_judgment").glob("*_single.jsonl"))
            if written and len(written[0].read_text().splitlines()) >= 2:
                break
            time.sleep(0.005)
        dying.stop()

    watcher = threading.Thread(target=kill_after_two)
    watcher.start()
    try:
        code, _, stderr = run_cli(eval_argv(files, out, dying.url, "--judge-retries", "2"), capsys)
    finally:
        watcher.join()
        dying.stop()
    assert code == 2
    assert_one_error_line(stderr)
    assert dying.url in stderr and "re-run" in stderr
    answers = read_jsonl(out / "model_answer" / "tiny-fora.jsonl")
    assert len(answers) == len(QUESTION_IDS)  # no answer lost
    judgments = next((out / "model_judgment").glob("*_single.jsonl"))
    kept = read_jsonl(judgments)
    assert 2 <= len(kept) < 2 * len(QUESTION_IDS)
    assert f"{len(kept)} judgments made so far are kept" in stderr

    # The same command against a live server asks only for the missing judgments, and answers nothing again.
    before = server.completions()
    code, _, stderr = run_cli(eval_argv(files, out, server.url), capsys)
    assert code == 0, stderr
    assert server.completions() - before == 2 * len(QUESTION_IDS) - len(kept)
    assert read_jsonl(out / "model_answer" / "tiny-fora.jsonl") == answers
    assert read_jsonl(judgments)[: len(kept)] == kept and len(read_jsonl(judgments)) == 2 * len(QUESTION_IDS)


# --------------------------------------------------------------------------------------------------- bad input
def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


BAD_INPUT = [
    (
        "unreachable-url",
        lambda f, t, s: ["--judge-base-url", f"http://127.0.0.1:{free_port()}/v1"],
        r"127\.0\.0\.1:\d+/v1 is unreachable",
    ),
    ("unset-key", lambda f, t, s: ["--judge-api-key-env", "FORA_TEST_UNSET_KEY"], r"\$FORA_TEST_UNSET_KEY is not set"),
    (
        "unknown-judge",
        lambda f, t, s: ["--judge-model", "gpt-17"],
        r"does not serve judge model 'gpt-17'; it serves: .*judge",
    ),
    (
        "question-bad-json",
        lambda f, t, s: ["--mt-bench", write(t / "q.jsonl", json.dumps(s[0]) + "\n" + '{"turns": [}\n')],
        r"q\.jsonl is not valid JSON Lines: .* at line 2",
    ),
    (
        "question-one-turn",
        lambda f, t, s: [
            "--mt-bench",
            write(t / "q.jsonl", json.dumps(s[0]) + "\n" + json.dumps(s[1] | {"turns": ["x"]}) + "\n"),
        ],
        r"q\.jsonl line 2: turns must be a list of 2 strings",
    ),
    (
        "reference-no-choices",
        lambda f, t, s: ["--mt-bench-reference", write(t / "ref.jsonl", '\n{"question_id": 111, "turns": ["x"]}\n')],
        r"ref\.jsonl line 2: choices must be a list",
    ),
    (
        "reference-missing",
        lambda f, t, s: [
            "--mt-bench-reference",
            write(t / "ref.jsonl", json.dumps({"question_id": 101, "choices": [{"turns": ["a", "b"]}]}) + "\n"),
        ],
        r"ref\.jsonl has no two-turn reference answer for question 111 \(math\)",
    ),
    (
        "bad-url",
        lambda f, t, s: ["--judge-base-url", "localhost:8000"],
        r"judge_base_url='localhost:8000' is not an http",
    ),
    ("bad-first-n", lambda f, t, s: ["--mt-bench-first-n", "0"], r"first_n=0 must be a positive integer"),
    ("no-mt-bench", lambda f, t, s: None, r"--judge-model .* add --mt-bench"),
]


@pytest.mark.slow
@pytest.mark.parametrize("build, message", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_exits_2_naming_the_value_and_keeps_answers(files, server, tmp_path, capsys, build, message):
    out = tmp_path / "eval"
    # Answers from an earlier run are there: a refused run must leave them as they are.
    earlier = out / "model_answer" / "tiny-fora.jsonl"
    earlier.parent.mkdir(parents=True)
    earlier.write_text(
        '{"question_id": 81, "model_id": "tiny-fora", "choices": [{"index": 0, "turns": ["a", "b"]}]}\n'
    )
    questions = load_questions(files["root"] / "questions.jsonl")
    extra = build(files, tmp_path, questions)
    argv = eval_argv(files, out, server.url, *(extra or []))
    if extra is None:
        argv = argv[: argv.index("--mt-bench")] + argv[argv.index("--mt-bench") + 2 :] + ["--wikitext", __file__]
    code, _, stderr = run_cli(argv, capsys)
    assert code == 2, stderr
    assert_one_error_line(stderr)
    assert re.search(message, stderr), stderr
    assert earlier.read_text().count("\n") == 1
    assert SECRET not in stderr


# ------------------------------------------------------------------------------------------- protocol, no server
@pytest.mark.parametrize(
    ("judgment", "rating"),
    [
        ("The answer is fine. Rating: [[8]]", 8),
        ("Rating: [[8.5]]", 8.5),
        ("I would give it [6] overall.", 6),  # FastChat's fallback: one bracket pair
        ("[[10]] but later [3]", 10),  # the double-bracket form wins
        ("Rating: 7/10", -1),
        ("", -1),
    ],
)
def test_rating_is_read_as_fastchat_reads_it(judgment, rating):
    assert parse_rating(judgment) == rating


def test_verdicts_are_read_as_fastchat_reads_them():
    assert [parse_verdict(t) for t in ("x [[A]]", "[[B]]", "a tie: [[C]]", "A is better")] == [
        "A",
        "B",
        "tie",
        "error",
    ]


def test_summary_matches_fastchats_show_result():
    pandas = pytest.importorskip("pandas")
    gen = torch.Generator().manual_seed(0)
    questions = load_questions()
    records = [
        {
            "question_id": q["question_id"],
            "model": m,
            "turn": t,
            "score": int(torch.randint(-1, 11, (1,), generator=gen)),
        }
        for q in questions
        for m in ("a", "b")
        for t in (1, 2)
    ]
    records = [r if r["score"] != 0 else {**r, "score": -1} for r in records]
    summary = single_summary(records, questions, "judge-x")
    # show_result.py: drop -1, then group means.
    df = pandas.DataFrame(records)
    df = df[df["score"] != -1]
    df["category"] = df["question_id"].map({q["question_id"]: q["category"] for q in questions})
    for model in ("a", "b"):
        rows = df[df["model"] == model]
        assert summary[model]["score"] == pytest.approx(rows["score"].mean())
        assert summary[model]["turn_1"] == pytest.approx(rows[rows["turn"] == 1]["score"].mean())
        assert summary[model]["turn_2"] == pytest.approx(rows[rows["turn"] == 2]["score"].mean())
        for category, mean in rows.groupby("category")["score"].mean().items():
            assert summary[model]["categories"][category] == pytest.approx(mean)
        assert summary[model]["unparsable"] == sum(r["model"] == model and r["score"] == -1 for r in records)
        assert summary[model]["judge"] == "judge-x"


def test_pairwise_counts_follow_show_result():
    rows = [
        ("model_1", "model_1"),
        ("model_2", "model_2"),
        ("model_1", "model_2"),
        ("tie", "tie"),
        ("error", "model_1"),
    ]
    records = [{"model_1": "a", "model_2": "b", "g1_winner": g1, "g2_winner": g2} for g1, g2 in rows]
    counts = pairwise_summary(records, "j")
    assert (counts["win"], counts["loss"], counts["tie"], counts["error"]) == (1, 1, 2, 1)


def test_judge_prompt_per_category_and_turn():
    prompts = mt_bench.load_judge_prompts()
    question = {"question_id": 111, "category": "reasoning", "turns": ["Q1?", "Q2?"]}
    answer = {"choices": [{"turns": ["A1.", "A2."]}]}
    ref = {"choices": [{"turns": ["R1.", "R2."]}]}
    turn_2 = mt_bench.single_prompt(prompts["single-math-v1-multi-turn"], question, answer, ref, 2)
    assert all(text in turn_2 for text in ("Q1?", "Q2?", "A1.", "A2.", "R1.", "R2."))
    turn_1 = mt_bench.single_prompt(prompts["single-v1"], question, answer, None, 1)
    assert "Q1?" in turn_1 and "A1." in turn_1 and "Q2?" not in turn_1


def test_bundled_data_is_the_80_questions_with_references():
    questions = load_questions(BUNDLED_QUESTIONS)
    assert len(questions) == 80 and {q["category"] for q in questions} == set(mt_bench.CATEGORIES)
    references = mt_bench.load_answers(mt_bench.BUNDLED_REFERENCE)
    mt_bench.check_references(questions, references, "bundled")
    assert set(mt_bench.load_judge_prompts()) == set(mt_bench.SINGLE_PROMPTS.values()) | set(
        mt_bench.PAIR_PROMPTS.values()
    )
    assert "Apache License" in (mt_bench.DATA_DIR / "NOTICE").read_text()


def test_a_truncated_last_judgment_is_dropped_and_asked_again(tmp_path):
    path = tmp_path / "j_single.jsonl"
    good = {"question_id": 1, "model": "m", "judge": ["j", "single-v1"], "turn": 1, "user_prompt": "p", "score": 3}
    path.write_text(json.dumps(good) + "\n" + '{"question_id": 2, "mod')
    store = mt_bench.JudgmentFile(path, mt_bench.SINGLE_GRADING.key)
    assert list(store.records.values()) == [good]
    assert path.read_text() == json.dumps(good) + "\n"


def test_config_refuses_unknown_ablation_keys():
    with pytest.raises(ValueError, match=r"ablation\.eval\.mt_bench has unknown keys \['judge'\]: they are none of"):
        MTBenchConfig.from_dict({"judge": "gpt-4"}, "ablation.eval.mt_bench")
    with pytest.raises(ValueError, match=r"judge_parallel=0 must be a positive integer"):
        MTBenchConfig(judge_model="gpt-4", judge_parallel=0)


@pytest.mark.slow
def test_fora_ablate_answers_and_judges_every_run(files, server, tmp_path, capsys):
    import yaml

    rows = [
        {"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)} for a in range(4) for b in range(4)
    ]
    (tmp_path / "sums.json").write_text(json.dumps(rows))
    config = {
        "model_name_or_path": str(files["base"]),
        "dtype": "float32",
        "dataset_name": str(tmp_path / "sums.json"),
        "lora_r": 2,
        "lora_alpha": 4,
        "lora_target_modules": TARGETS,
        "fora_fisher_batches": 1,
        "output_dir": str(tmp_path / "unused"),
        "use_cpu": True,
        "bf16": False,
        "activation_checkpointing": False,
        "per_device_train_batch_size": 4,
        "max_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "ablation": {
            "output_dir": str(tmp_path / "grid"),
            "runs": ["lora", "fora"],
            "eval": {
                "eval_loss_examples": 0,
                "mt_bench": {
                    "questions": str(files["root"] / "questions.jsonl"),
                    "max_new_tokens": 4,
                    "judge_model": str(files["judge"]),
                    "judge_base_url": server.url,
                    "judge_api_key_env": "FORA_TEST_JUDGE_KEY",
                },
            },
        },
    }
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(config))
    before = server.completions()
    assert main(["ablate", str(tmp_path / "grid.yaml")]) == 0
    out = tmp_path / "grid" / "mt_bench"
    records = read_jsonl(next((out / "model_judgment").glob("*_single.jsonl")))
    assert sorted({r["model"] for r in records}) == ["fora", "lora"] and len(records) == 4 * len(QUESTION_IDS)
    assert server.completions() - before == len(records)  # the closing table reads the cache
    for run in ("lora", "fora"):
        result = json.loads((tmp_path / "grid" / run / "results.json").read_text())["mt_bench"]
        assert result["summary"][run]["score"] == 5.5 and result["summary"][run]["unparsable"] == 2
    table = (tmp_path / "grid" / "ablation.md").read_text()
    assert f"| lora | {files['judge']} | 5.50 |" in table and f"| fora | {files['judge']} | 5.50 |" in table
    assert (out / "mt_bench.png").is_file()


def test_ablate_refuses_a_bad_mt_bench_block_before_training(tmp_path):
    from fora_plugin.ablate import load_ablation_config

    (tmp_path / "d.json").write_text("[]")
    block = {"runs": ["fora"], "eval": {"mt_bench": {"judge_model": "gpt-4", "max_new_token": 8}}}
    (tmp_path / "a.yaml").write_text(json.dumps({"dataset_name": "d.json", "ablation": block}))
    with pytest.raises(ValueError, match=r"ablation\.eval\.mt_bench has unknown keys \['max_new_token'\]"):
        load_ablation_config(str(tmp_path / "a.yaml"))


def test_eval_flags_build_the_config_and_bare_mt_bench_means_the_bundled_questions():
    from fora_plugin.cli import build_parser

    args = build_parser().parse_args(
        [
            "eval",
            "--base",
            "m",
            "--mt-bench",
            "--judge-model",
            "gpt-4",
            "--judge-retries",
            "2",
            "--mt-bench-first-n",
            "3",
        ]
    )
    config = mt_bench.config_from_args(args)
    assert (config.questions, config.judge_model, config.judge_retries, config.first_n) == (None, "gpt-4", 2, 3)
    assert config.judge_max_tokens == MTBenchConfig.judge_max_tokens  # unset flags keep the dataclass defaults
    assert mt_bench.prepare(MTBenchConfig(first_n=3)).questions == load_questions()[:3]


def test_without_a_judge_the_answers_are_written_for_fastchat(files, tmp_path, capsys):
    out = tmp_path / "eval"
    argv = eval_argv(files, out, "http://unused")
    argv = argv[: argv.index("--judge-model")]
    code, stdout, stderr = run_cli(argv, capsys)
    assert code == 0, stderr
    answers = read_jsonl(out / "model_answer" / "tiny-fora.jsonl")
    assert [a["question_id"] for a in answers] == list(QUESTION_IDS)
    assert "--judge-model" in stdout and "gen_judgment.py" in stdout
    assert not (out / "model_judgment").exists()
    # Answers made with other settings under the same model_id are refused, not judged as if they were these.
    longer = [
        *argv[: argv.index("--mt-bench-max-new-tokens") + 1],
        "7",
        *argv[argv.index("--mt-bench-max-new-tokens") + 2 :],
    ]
    code, _, stderr = run_cli(longer, capsys)
    assert code == 2 and "made with other settings (max_new_tokens: [6] then, [7] now)" in stderr, stderr


def test_an_mt_bench_block_refuses_a_misspelt_key_and_judging_without_a_judge():
    with pytest.raises(
        ValueError, match=r"unknown keys \['judge_modle'\]: .*For judge_modle, did you mean judge_model\?"
    ):
        MTBenchConfig.from_dict({"judge_modle": "gpt-4"}, "ablation.eval.mt_bench")
    with pytest.raises(ValueError, match=r"ablation\.eval\.mt_bench\.judge_timeout is set but no judge is"):
        MTBenchConfig.from_dict({"judge_timeout": 5}, "ablation.eval.mt_bench")
    assert MTBenchConfig.from_dict({"judge_model": "j", "judge_timeout": 5}, "b").judge_timeout == 5
