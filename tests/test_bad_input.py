"""Errors a user can cause: each is one clear sentence, and the scripts print it (``error: ...``) and exit 2
without a traceback. A representative subset runs the scripts as subprocesses (concurrently, to keep
the time down); the rest calls the API and checks the named exception and its message."""

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from llama_lite import Llama4
from llama_lite.checkpoint import Checkpoint, read_model_args
from llama_lite.errors import CheckpointError, ConfigError, LlamaLiteError, TokenizerError


class Payload:
    """Unpickling this opens (creates) ``marker``: a stand-in for any code a .pth could run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_payload_pth(path: Path, marker: Path) -> None:
    torch.save({"tok_embeddings.weight": torch.zeros(4, 4, dtype=torch.bfloat16), "x": Payload(marker)}, path)


def link(src: Path, dst: Path) -> None:
    dst.symlink_to(src.resolve())


def folder(root: Path, name: str, src: Path, *, params: dict | str | None = None, shards=(0,),
           tokenizer: bool = True) -> Path:
    """A checkpoint folder made of links to ``src``'s files, with params.json replaced when given."""
    out = root / name
    out.mkdir()
    if params is None:
        shutil.copyfile(src / "params.json", out / "params.json")
    elif params != "absent":
        (out / "params.json").write_text(params if isinstance(params, str) else json.dumps(params))
    for i in shards:
        link(src / f"consolidated.{i:02d}.pth", out / f"consolidated.{i:02d}.pth")
    if tokenizer:
        link(src / "tokenizer.model", out / "tokenizer.model")
    return out


@pytest.fixture(scope="module")
def bad(tmp_path_factory, tiny_ckpt, tiny_ckpt_mp2, tiny_ckpt_hf) -> dict[str, Path]:
    """Broken checkpoints, one per kind of damage."""
    root = tmp_path_factory.mktemp("bad")
    params = json.loads((tiny_ckpt / "params.json").read_text())
    dirs = {
        "no_params": folder(root, "no_params", tiny_ckpt, params="absent"),
        "garbled_params": folder(root, "garbled_params", tiny_ckpt, params='{"dim": 128, "n_layers": '),
        "params_not_object": folder(root, "params_not_object", tiny_ckpt, params="[1, 2, 3]"),
        "wrong_type": folder(root, "wrong_type", tiny_ckpt, params={**params, "dim": "128"}),
        "wrong_moe_type": folder(root, "wrong_moe_type", tiny_ckpt, params={**params, "moe_args": 4}),
        "unknown_key": folder(root, "unknown_key", tiny_ckpt, params={**params, "n_layerz": 4}),
        "vocab_mismatch": folder(root, "vocab_mismatch", tiny_ckpt, params={**params, "vocab_size": 128256}),
        "shape_mismatch": folder(root, "shape_mismatch", tiny_ckpt, params={**params, "multiple_of": 512}),
        "extra_layers": folder(root, "extra_layers", tiny_ckpt, params={**params, "n_layers": 2}),
        "missing_shard": folder(root, "missing_shard", tiny_ckpt_mp2, shards=(0,)),
        "three_shards": folder(root, "three_shards", tiny_ckpt, shards=()),
        "no_tokenizer": folder(root, "no_tokenizer", tiny_ckpt, tokenizer=False),
    }
    for i in range(3):
        link(tiny_ckpt / "consolidated.00.pth", dirs["three_shards"] / f"consolidated.{i:02d}.pth")

    truncated = dirs["truncated"] = folder(root, "truncated", tiny_ckpt, shards=())
    with open(tiny_ckpt / "consolidated.00.pth", "rb") as f:
        (truncated / "consolidated.00.pth").write_bytes(f.read(4 << 20))

    # Shards from different models: shard 1 lacks the last layer (as if from a 3-layer model).
    mixed = dirs["mixed_models"] = folder(root, "mixed_models", tiny_ckpt_mp2, shards=(0,))
    other = torch.load(tiny_ckpt_mp2 / "consolidated.01.pth", map_location="cpu", mmap=True, weights_only=True)
    torch.save({k: v for k, v in other.items() if not k.startswith("layers.3.")}, mixed / "consolidated.01.pth")

    evil = dirs["pickle_payload"] = folder(root, "pickle_payload", tiny_ckpt, shards=())
    write_payload_pth(evil / "consolidated.00.pth", root / "PWNED")

    hf = dirs["bad_safetensors"] = root / "bad_safetensors"
    hf.mkdir()
    shutil.copyfile(tiny_ckpt_hf / "config.json", hf / "config.json")
    link(tiny_ckpt_hf / "tokenizer.model", hf / "tokenizer.model")
    # A header length far beyond the file, then bytes that are not JSON.
    (hf / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"\x00garbage" * 100)

    not_a_folder = dirs["not_a_folder"] = root / "a_file"
    not_a_folder.write_text("hello")
    return dirs


def assert_one_sentence(message: str) -> None:
    """One line, one sentence (no ". " inside, "e.g. " aside), no terminal escapes, no traceback."""
    text = message.strip()
    if os.environ.get("LLAMA_LITE_RECORD_ERRORS"):  # collect the observed messages for a report
        with open(os.environ["LLAMA_LITE_RECORD_ERRORS"], "a") as f:
            f.write(text + "\n")
    assert text and "\n" not in text and "\x1b" not in text, message
    assert ". " not in text.replace("e.g. ", ""), message
    assert "Traceback" not in text


# --- the scripts, as subprocesses -------------------------------------------------------------
# id -> (module, [checkpoint key or path, flags...], a phrase of the error). Flag errors raised before the
# model loads are also checked in-process below (test_flag_values_are_refused), more cheaply.
SCRIPT_CASES = {
    "missing_folder": ("scripts.completion", ["/nonexistent/llama", "--prompt", "hi"], "does not exist"),
    "garbled_params": ("scripts.completion", ["garbled_params", "--prompt", "hi"], "not valid JSON"),
    "missing_shard": ("scripts.completion", ["missing_shard", "--prompt", "hi"], "consolidated.01.pth is missing"),
    "pickle_payload": ("scripts.chat_completion", ["pickle_payload", "--prompt", "hi"], "refused to load"),
    "prompt_too_long": ("scripts.completion", ["TINY", "--prompt", "one two three four five six seven",
                                                "--max_seq_len", "6"], "max_seq_len 6"),
    "quantization_mode": ("scripts.chat_completion", ["TINY", "--quantization_mode", "bogus"], "quantization_mode"),
    "temperature": ("scripts.completion", ["TINY", "--prompt", "hi", "--temperature", "-1"], "--temperature"),
    "empty_prompt": ("scripts.chat_completion", ["TINY", "--prompt", ""], "--prompt is empty"),
    "unknown_flag": ("scripts.chat_completion", ["TINY", "--temprature", "0"], "unknown flag --temprature"),
}


@pytest.fixture(scope="module")
def script_results(bad, tiny_ckpt, run_script):
    def run(case):
        module, args, _ = SCRIPT_CASES[case]
        where = {"TINY": tiny_ckpt, **bad}
        args = [str(where.get(a, a)) for a in args]
        return run_script(module, *args, timeout=180)

    # Each run is mostly Python start-up and imports; running them side by side keeps the cores busy.
    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(SCRIPT_CASES, pool.map(run, SCRIPT_CASES)))


@pytest.mark.parametrize("case", list(SCRIPT_CASES))
def test_script_prints_one_line_and_exits_2(script_results, case):
    result = script_results[case]
    phrase = SCRIPT_CASES[case][2]
    assert result.returncode == 2, (result.stdout, result.stderr)
    # A run that got as far as loading the model has said its KV cache size first.
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("KV cache: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert phrase in lines[0]
    assert_one_sentence(lines[0])
    assert result.stdout.strip() == ""


def test_pickle_payload_did_not_run(script_results, bad):
    assert script_results["pickle_payload"].returncode == 2
    assert not (bad["pickle_payload"].parent / "PWNED").exists()


def test_the_payload_is_live_when_loaded_unsafely(tmp_path):
    """The refusal above means something: loaded without weights_only, the same file runs its code."""
    write_payload_pth(tmp_path / "evil.pth", tmp_path / "ran")
    torch.load(tmp_path / "evil.pth", weights_only=False)
    assert (tmp_path / "ran").exists()


def test_fire_usage_error_exits_nonzero(run_script):
    result = run_script("scripts.completion")  # no checkpoint folder
    assert result.returncode == 2
    assert "checkpoint_dir" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "module, kwargs, phrase",
    [
        ("completion", dict(prompt="hi", top_p=2), "--top_p"),
        ("chat_completion", dict(top_p=0), "--top_p"),
        ("completion", dict(prompt="hi", temperature="hot"), "--temperature"),
        ("completion", dict(prompt="hi", max_gen_len=0), "--max_gen_len"),
        ("completion", dict(prompt="hi", max_seq_len=-5), "--max_seq_len"),
        ("chat_completion", dict(max_batch_size=0), "--max_batch_size"),
        ("completion", dict(prompt="hi", world_size=0), "--world_size"),
        ("completion", dict(prompt="hi", seed=1.5), "--seed"),
        ("completion", dict(prompt="hi", dtype="fp8"), "--dtype"),
        ("completion", dict(prompt="hi", quantization_mode="int3"), "quantization_mode"),
        ("completion", dict(prompt="hi", kernels="fast"), "--kernels"),
        ("completion", dict(prompt=""), "--prompt is empty"),
        ("completion", dict(), "--prompt is required"),
        ("chat_completion", dict(prompt=["a", "b"]), "--prompt must be text"),
        ("random_checkpoint", dict(preset="huge"), "unknown --preset"),
        ("random_checkpoint", dict(format="gguf"), "unknown --format"),
        ("random_checkpoint", dict(mp=0), "--mp"),
        ("random_checkpoint", dict(format="hf", mp=2), "unsharded"),
    ],
)
def test_flag_values_are_refused(tiny_ckpt, tmp_path, module, kwargs, phrase):
    """The scripts' main() raises FlagError (printed as one line, exit 2) before loading anything."""
    import importlib

    from scripts.common import FlagError

    main = importlib.import_module(f"scripts.{module}").main
    target = tmp_path / "new" if module == "random_checkpoint" else tiny_ckpt
    with pytest.raises(FlagError, match=re.escape(phrase)) as info:
        main(str(target), **kwargs)
    assert_one_sentence(str(info.value))
    assert not (tmp_path / "new").exists()


# --- the API ------------------------------------------------------------------------------------
API_CASES = {
    "no_params": (ConfigError, "neither params.json"),
    "garbled_params": (ConfigError, "not valid JSON"),
    "params_not_object": (ConfigError, "JSON object"),
    "wrong_type": (ConfigError, "'dim' in params.json must be a number"),
    "wrong_moe_type": (ConfigError, "'moe_args' in params.json must be an object"),
    "unknown_key": (ConfigError, "unknown key(s) n_layerz"),
    "vocab_mismatch": (ConfigError, "does not match the tokenizer"),
    "shape_mismatch": (CheckpointError, "has shape"),
    "extra_layers": (CheckpointError, "layers beyond the 2 in its config"),
    "missing_shard": (CheckpointError, "consolidated.01.pth is missing"),
    "truncated": (CheckpointError, "truncated"),
    "mixed_models": (CheckpointError, "holds different tensors"),
    "pickle_payload": (CheckpointError, "unpickling it would call io.open"),
    "bad_safetensors": (CheckpointError, "corrupted safetensors"),
    "not_a_folder": (CheckpointError, "is not a folder"),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_build_raises_one_named_sentence(bad, case, dist1):
    kind, phrase = API_CASES[case]
    with pytest.raises(kind) as info:
        Llama4.build(bad[case], max_seq_len=32, max_batch_size=1)
    assert phrase in str(info.value)
    assert_one_sentence(str(info.value))
    assert not (bad["pickle_payload"].parent / "PWNED").exists()


def test_missing_tokenizer_with_a_bad_path(bad, dist1):
    """No tokenizer.model in the folder, and the path given instead does not exist (no fallback is used)."""
    with pytest.raises(TokenizerError, match="does not exist"):
        Llama4.build(bad["no_tokenizer"], max_seq_len=32, max_batch_size=1, tokenizer_path=bad["no_tokenizer"] / "nope")


def test_a_weights_file_passed_as_tokenizer_is_refused(bad, tiny_ckpt, dist1):
    with pytest.raises(TokenizerError, match="not a tiktoken BPE file"):
        Llama4.build(tiny_ckpt, max_seq_len=32, max_batch_size=1, tokenizer_path=tiny_ckpt / "consolidated.00.pth")


def test_three_shards_on_world_size_two(bad):
    args = read_model_args(bad["three_shards"])
    with pytest.raises(CheckpointError, match="3 model-parallel shards cannot be loaded on world size 2") as info:
        Checkpoint(bad["three_shards"], args, world_size=2, rank=1).keys()
    assert_one_sentence(str(info.value))


def test_unreadable_folder(tmp_path, monkeypatch):
    folder_ = tmp_path / "locked"
    folder_.mkdir()
    if os.geteuid() == 0:
        # root reads any folder, so make listing it fail the way a permission problem does
        def deny(self):
            raise PermissionError(13, "Permission denied", str(self))

        monkeypatch.setattr(Path, "iterdir", deny)
    else:
        folder_.chmod(0)
    try:
        with pytest.raises(CheckpointError, match="is not readable"):
            read_model_args(folder_)
    finally:
        folder_.chmod(0o755)


@pytest.mark.parametrize(
    "kwargs, phrase",
    [(dict(max_seq_len=0), "max_seq_len"), (dict(max_batch_size="4"), "max_batch_size"),
     (dict(world_size=3), "torchrun --nproc-per-node 3")],
)
def test_bad_build_arguments(tiny_ckpt, dist1, kwargs, phrase):
    with pytest.raises(LlamaLiteError, match=phrase):
        Llama4.build(tiny_ckpt, **{"max_seq_len": 32, "max_batch_size": 1, **kwargs})


def test_user_errors_are_llama_lite_errors():
    """The scripts catch LlamaLiteError; every named error derives from it."""
    for kind in (ConfigError, CheckpointError, TokenizerError):
        assert issubclass(kind, LlamaLiteError)


@pytest.mark.parametrize("case", ["unknown", "above_this_cpu"])
def test_cpu_cap_is_checked_up_front(tiny_ckpt, run_script, case):
    """LLAMA_LITE_CPU_ISA: a name that is not a path, or a cap above what this CPU has, is one
    line and exit 2 before anything loads (on a CPU that has every path, the best one must run)."""
    import os

    from kernels import cpu

    missing = [c for c in cpu.ISAS if c not in cpu.cpu_isas()]
    if case == "unknown":
        value, phrase = "avx1024", "unknown CPU path 'avx1024'"
    elif missing:
        value, phrase = missing[-1], f"LLAMA_LITE_CPU_ISA={missing[-1]} needs CPU features this CPU lacks"
    else:
        value, phrase = cpu.ISAS[0], None
    env = {**os.environ, "LLAMA_LITE_CPU_ISA": value}
    result = run_script("scripts.completion", tiny_ckpt, "--prompt", "hi", "--max_gen_len", "2", env=env)
    if phrase is None:
        assert result.returncode == 0, result.stderr[-2000:]
        return
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and phrase in lines[0] and "Traceback" not in result.stderr
