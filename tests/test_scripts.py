"""The command-line scripts, run as a user runs them: output, exit status, interactive mode, help."""

import inspect
import io
import re
from typing import Optional

import fire

import pytest

from llama_lite.chat_format import RawMessage
from scripts import chat_completion, completion, int4_demo, perplexity, random_checkpoint
from scripts.common import FLAG_HELP, FlagError, check_flag_names, quote_text_flags, stream_text


def expected_text(llama, steps) -> str:
    out = io.StringIO()
    tokens, _, _ = stream_text(llama, steps, out=out)
    assert tokens, "the model stopped at once; pick another prompt"
    return out.getvalue()


def assert_clean(result) -> None:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_completion_prints_only_the_new_text(run_script, tiny_ckpt, tiny_llama):
    prompt = "The capital of France is"
    want = expected_text(tiny_llama, tiny_llama.completion([prompt], temperature=0, max_gen_len=6))
    got = run_script("scripts.completion", tiny_ckpt, "--prompt", prompt, "--max_gen_len", 6, "--temperature", 0)
    assert_clean(got)
    assert got.stdout == want + "\n"
    assert prompt not in got.stdout


def test_chat_completion_answers_one_prompt(run_script, tiny_ckpt, tiny_llama):
    question = "Hi, what is 2 + 2?"  # the comma: fire alone would pass a tuple
    dialog = [RawMessage(role="user", content=question)]
    want = expected_text(tiny_llama, tiny_llama.chat_completion([dialog], temperature=0, max_gen_len=6))
    got = run_script("scripts.chat_completion", tiny_ckpt, "--prompt", question, "--max_gen_len", 6,
                     "--temperature", 0)
    assert_clean(got)
    assert got.stdout == want + "\n"


def test_chat_completion_demo_dialogs_run_in_batches(run_script, tiny_ckpt):
    """Four demo dialogs in batches of 3: a full batch, then one of a single dialog."""
    got = run_script("scripts.chat_completion", tiny_ckpt, "--max_gen_len", 3, "--max_batch_size", 3,
                     "--max_seq_len", 256)
    assert_clean(got)
    assert got.stdout.count("> Assistant:") == len(chat_completion.DEMO_DIALOGS) == 4
    assert "User: What is the recipe of mayonnaise?" in got.stdout
    assert "System: Always answer with Haiku" in got.stdout


def test_interactive_chat_streams_replies_and_exits(run_script, tiny_ckpt):
    got = run_script("scripts.chat_completion", tiny_ckpt, "--interactive", "--max_gen_len", 4, "--temperature", 0,
                     stdin="hi\n\nreset\nhello again\nexit\nnever read\n")
    assert_clean(got)
    assert len(re.findall(r"\[\d+ tokens in [\d.]+ s, [\d.]+ tokens/s\]", got.stdout)) == 2
    assert got.stdout.count("assistant> ") == 2
    assert "(new conversation)" in got.stdout


def test_interactive_chat_ends_at_end_of_input(run_script, tiny_ckpt):
    got = run_script("scripts.chat_completion", tiny_ckpt, "--interactive", "--max_gen_len", 3, stdin="hi\n")
    assert_clean(got)
    assert "tokens/s" in got.stdout


def test_random_checkpoint_refuses_an_existing_folder_without_force(run_script, tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    refused = run_script("scripts.random_checkpoint", out, "--preset", "tiny")
    assert refused.returncode == 2
    assert refused.stderr.strip().startswith("error:") and "already exists" in refused.stderr
    assert "--force" in refused.stderr and "Traceback" not in refused.stderr
    assert (out / "keep.txt").read_text() == "mine"

    forced = run_script("scripts.random_checkpoint", out, "--preset", "tiny", "--mp", 2, "--seed", 3, "--force")
    assert_clean(forced)
    assert sorted(p.name for p in out.iterdir()) == [
        "consolidated.00.pth", "consolidated.01.pth", "params.json", "tokenizer.model"]
    assert "wrote" in forced.stdout


@pytest.mark.parametrize("fn", [chat_completion.main, completion.main, random_checkpoint.main, int4_demo.demo,
                                perplexity.main], ids=lambda f: f.__module__)
def test_every_flag_has_help_text(fn):
    """fire shows the docstring's Args: section as each flag's help; a shared flag's entry is
    FLAG_HELP's text, filled in where the docstring names it."""
    doc = inspect.getdoc(fn)
    documented = set(re.findall(r"^    (\w+): \S", doc.split("Args:", 1)[1], flags=re.M))
    assert documented == set(inspect.signature(fn).parameters)
    assert not re.search(r"^ *\{\w+\}$", doc, flags=re.M)


def _entry_points():
    from scripts import bench_context, bench_kernels, benchmark, gpu_check, quantize

    return [chat_completion.main, completion.main, random_checkpoint.main, int4_demo.demo, perplexity.main,
            quantize.quantize, benchmark.main, bench_kernels.main, bench_context.main, gpu_check.gpu_check]


@pytest.mark.parametrize("fn", _entry_points(), ids=lambda f: f.__module__)
def test_fire_shows_each_flags_whole_help(fn):
    """fire's docstring parser keeps only the text before a colon on an entry's later lines (and
    takes ``word:`` there for a new flag): every flag's help as fire parses it is the whole entry."""
    from fire import docstrings

    doc = inspect.getdoc(fn)
    entries = re.findall(r"^    (\w+): (.*?)(?=^    \w+: |\Z)", doc.split("Args:", 1)[1], flags=re.M | re.S)
    parsed = {a.name: " ".join(a.description.split()) for a in docstrings.parse(doc).args}
    assert entries and {name: " ".join(text.split()) for name, text in entries} == parsed


def test_shared_flags_say_the_same_in_every_script():
    for name in ("world_size", "dtype", "kernels"):
        first_line = FLAG_HELP[name].split("\n")[0]
        for fn in (chat_completion.main, completion.main, perplexity.main):
            assert f"    {name}: {first_line}" in inspect.getdoc(fn)
    assert "compile: " + FLAG_HELP["compile"].split("\n")[0] in inspect.getdoc(int4_demo.demo)


def test_quantization_mode_is_accepted_by_both_chat_scripts():
    for module in (chat_completion, completion):
        assert inspect.signature(module.main).parameters["quantization_mode"].default == "none"


def test_misspelt_flags_are_refused_before_running():
    check_flag_names(completion.main, ["ckpt", "--prompt", "x", "--max-gen-len=3", "--temperature", "-1"])
    check_flag_names(chat_completion.main, ["ckpt", "--nointeractive", "--", "--help"])
    with pytest.raises(FlagError, match="--max_gen"):
        check_flag_names(completion.main, ["ckpt", "--max_gen", "3"])


@pytest.mark.parametrize("text", ["hello, world", "1e3", "None", "[1, 2]", "True", "it's \"quoted\"", "-- not a flag"])
def test_text_flags_reach_main_as_typed(text):
    got = {}

    def main(prompt: Optional[str] = None, n: int = 1, temperature: float = 0.6) -> None:
        got.update(prompt=prompt, n=n, temperature=temperature)

    for argv in (["--prompt", text, "--n", "3", "--temperature", "0"], [f"--prompt={text}", "--n=3", "--temperature=0"]):
        got.clear()
        fire.Fire(main, quote_text_flags(main, argv))
        assert got == {"prompt": text, "n": 3, "temperature": 0}
