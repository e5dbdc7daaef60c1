"""The command line: `hybrid-jax generate` / `convert`, as a user meets it (errors run the real entry point
in a subprocess: status 2, one line, no traceback)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_jax.cli import build_parser, main
from hybrid_jax.recall import MODEL_DIR

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "kimi_linear"
FAST = ["--max-new-tokens", "5", "--compile-cache", ""]
TINY = ["--config", "tiny", *FAST]  # random weights of a preset, by name


def _run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "hybrid_jax", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


@pytest.mark.slow
def test_cli_default_answers_its_recall_prompt(capsys):
    """No model named: the shipped recall model answers the default prompt (cd -> 42), then stops at EOS."""
    assert main(FAST) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "model: the embedded recall model" in out
    assert "prompt: 'kv:31 ab:17 cd:42 ef:03 gh:58 ij:76 ?cd:'" in out
    assert "generated: '42'" in out and "recall: asked for 'cd', answered '42' (right)" in out
    m = re.search(r"(\d+) tokens in [\d.]+ s: ([\d.]+) tokens/s \(compilation [\d.]+ s, before that\)", out)
    assert m and int(m.group(1)) == 3 and float(m.group(2)) > 0  # two digits and EOS
    assert "compiling generate" in captured.err  # the notice while the one generate call compiles
    assert main([*FAST, "--prompt", "zq:07 ab:61 ?zq:"]) == 0  # any prompt in the format
    assert "recall: asked for 'zq', answered '07' (right)" in capsys.readouterr().out
    assert main([*FAST, "--prompt", "hello"]) == 0  # not the format: text, but no verdict
    out = capsys.readouterr().out
    assert "generated: " in out and "recall: the prompt is not in the key:value format" in out
    assert main([*FAST, "--model", str(MODEL_DIR), "--prompt", "ab:17 ?ab:"]) == 0  # named: the same checks
    assert "recall: asked for 'ab', answered '17' (right)" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_presets_still_run_with_random_weights(capsys):
    assert main(TINY) == 0
    out = capsys.readouterr().out
    assert "model: tiny" in out and "random weights from --weights-seed 0" in out and "recall:" not in out
    m = re.search(r"(\d+) tokens in [\d.]+ s", out)
    assert m and 1 <= int(m.group(1)) <= 5


@pytest.mark.slow
def test_cli_takes_a_quant_file(tmp_path, capsys):
    q = tmp_path / "q.yaml"
    q.write_text("indexer: {dtype: mxfp8}\nkv_cache: {dtype: fp8, tile_size: 16}\nprojection: {dtype: bf16}\n")
    assert main(["generate", *FAST, "--quant", str(q)]) == 0
    assert "tokens/s" in capsys.readouterr().out


@pytest.mark.slow
def test_quiet_and_stream_print_the_same_text(capsys):
    from hybrid_jax.tokenizer import ByteTokenizer

    assert main([*FAST, "--quiet"]) == 0
    quiet = capsys.readouterr().out
    assert main([*FAST, "--quiet", "--stream"]) == 0
    assert capsys.readouterr().out == quiet  # the text alone, once, however it is printed
    assert main(FAST) == 0
    tokens = json.loads(re.search(r"tokens: (\[[\d, ]*\])", capsys.readouterr().out).group(1))
    assert quiet == ByteTokenizer().decode(tokens) + "\n"
    assert main([*FAST, "--stream"]) == 0
    out = capsys.readouterr().out
    assert f"generated: {quiet}" in out and "tokens/s" in out


@pytest.mark.slow
def test_seed_seeds_sampling_not_the_weights(capsys):
    def tokens(*extra):
        assert main([*TINY, "--quiet", "--prompt-ids", "1,2,3", *extra]) == 0
        return capsys.readouterr().out

    base = tokens("--seed", "0")
    assert tokens("--seed", "7") == base  # greedy: the seed of the sampling changes nothing
    assert tokens("--weights-seed", "3") != base  # other random weights
    sampled = [tokens("--temperature", "1.5", "--seed", str(s)) for s in (0, 1, 2)]
    assert len(set(sampled)) > 1


def test_help_documents_every_flag_with_its_default():
    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    for action in generate._actions:
        if action.dest == "help":
            continue
        assert action.help, action.dest
    text = generate.format_help()
    for flag in ("--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--stream"):
        assert flag in text
    assert "(default: 32)" in text and "(default: 0.0)" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-new-tokens", "-5"], "argument --max-new-tokens: -5 must be at least 1"),
        (["--top-k", "0"], "argument --top-k: 0 must be at least 1"),
        (["--top-p", "1.5"], "argument --top-p: 1.5 must lie in (0, 1]"),
        (["--temperature", "-1"], "argument --temperature: -1.0 must be >= 0"),
        (["--prompt-ids", "a,b"], "argument --prompt-ids: 'a,b': expected comma-separated integers"),
        (["--model", "/missing"], "--model '/missing': no such folder"),
        (["--quant", "missing.yaml"], "--quant 'missing.yaml': no such file"),
        (["--config", "nope"], "--config 'nope': neither a preset"),
        (["--tp", "3"], "--dp 1 x --tp 3 = 3 devices; this job has 1"),
        (["--prompt-ids", "1,2,999999"], "token id 999999 is outside the vocabulary [0, 260)"),
        (["--top-k", "100000"], "--top-k 100000 exceeds the vocabulary size 260"),
        (["--config", "tiny", "--top-k", "300"], "--top-k 300 exceeds the vocabulary size 288"),
        (["--config", "tiny", "--draft", "mtp"], "draft='mtp': this model carries no multi-token-prediction layer"),
    ],
)
def test_user_errors_are_one_line_with_status_2(args, message):
    proc = _run("generate", "--compile-cache", "", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("hybrid-jax: error: ") and message in lines[-1], proc.stderr
    assert not [line for line in lines if line.startswith("hybrid-jax: error") is False and "usage" in line]


def test_convert_refuses_an_existing_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = _run("convert", str(FIXTURE), str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"hybrid-jax: error: '{out}' exists; pass --force to replace it"
    proc = _run("convert", str(tmp_path / "nothing"), str(tmp_path / "out2"))
    assert proc.returncode == 2 and "no such folder" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_draft_ngram_generates_the_same_tokens(capsys):
    """--draft ngram prints the default run's tokens and the drafts it accepted."""
    assert main(FAST) == 0
    plain = re.search(r"^tokens: \[.*\]$", capsys.readouterr().out, re.M).group(0)
    assert main([*FAST, "--draft", "ngram", "--num-draft", "3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^tokens: \[.*\]$", out, re.M).group(0) == plain
    assert re.search(r"speculative \(ngram\): \d+ of \d+ drafted tokens accepted", out), out


@pytest.mark.slow
def test_prefill_chunk_changes_nothing_but_memory(capsys):
    assert main([*FAST, "--quiet"]) == 0
    one_shot = capsys.readouterr().out
    assert main([*FAST, "--quiet", "--prefill-chunk", "4"]) == 0  # the default prompt is 41 tokens: 11 chunks
    assert capsys.readouterr().out == one_shot
