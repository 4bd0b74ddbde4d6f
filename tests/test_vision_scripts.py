"""Images through the command-line scripts: --image, /image, the two-image demo dialog,
random_checkpoint --vision, and one-line errors for bad image input."""

import io

import pytest

from helpers import make_checkpoint
from llama_lite.chat_format import RawMediaItem, RawMessage, RawTextItem
from llama_lite.checkpoint import Checkpoint, read_model_args
from llama_lite.generation import Llama4
from llama_lite.synthetic import VISION_ARGS
from llama_lite.errors import PromptError
from scripts import chat_completion
from scripts.common import FlagError, stream_text
from scripts.demo_images import boat, sunset


@pytest.fixture(scope="module")
def vision_ckpt(ckpt_root):
    # The same folder as test_vision's (written once per session).
    return make_checkpoint(ckpt_root, "vision-meta", preset="tiny", seed=5,
                           overrides=dict(vision_args=VISION_ARGS, attn_temperature_tuning=False))


@pytest.fixture(scope="module")
def llama(vision_ckpt, dist1):
    return Llama4.build(vision_ckpt, max_seq_len=256, max_batch_size=4)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pictures")
    paths = [folder / "sunset.png", folder / "boat.jpg"]
    sunset().save(paths[0])
    boat().save(paths[1])
    assert all(p.stat().st_size < 100_000 for p in paths)
    return paths


def api_text(llama, dialog) -> str:
    out = io.StringIO()
    tokens, _, _ = stream_text(llama, llama.chat_completion([dialog], temperature=0, max_gen_len=8), out=out)
    assert tokens
    return out.getvalue()


def assert_user_error(result, *words) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.stderr, result.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_prompt_with_two_images_equals_the_api(run_script, vision_ckpt, llama, pictures):
    question = "Write a haiku that brings both images together"
    content = [RawMediaItem(data=p) for p in pictures] + [RawTextItem(text=question)]
    want = api_text(llama, [RawMessage(role="user", content=content)])
    got = run_script("scripts.chat_completion", vision_ckpt, "--prompt", question, "--image", pictures[0],
                     "--image", pictures[1], "--max_gen_len", 8, "--temperature", 0, "--max_seq_len", 256)
    assert got.returncode == 0 and "Traceback" not in got.stderr, got.stderr
    assert got.stdout == want + "\n"
    # Not the text-only answer: the images reached the model.
    assert want != api_text(llama, [RawMessage(role="user", content=question)])


def test_interactive_image_line_attaches_to_the_next_message(run_script, vision_ckpt, llama, pictures):
    want = api_text(llama, [RawMessage(role="user", content=[RawMediaItem(data=pictures[1]), RawTextItem(text="What is it?")])])
    got = run_script("scripts.chat_completion", vision_ckpt, "--interactive", "--max_gen_len", 8, "--temperature", 0,
                     "--max_seq_len", 256, stdin=f"/image {pictures[1]}\n/image nowhere.png\nWhat is it?\nexit\n")
    assert got.returncode == 0, got.stderr
    assert f"(image {pictures[1]} attached to your next message)" in got.stdout
    assert "nowhere.png does not exist" in got.stderr
    assert "assistant> " + want + "\n" in got.stdout


def test_demo_dialogs_include_the_two_image_dialog(run_script, vision_ckpt):
    got = run_script("scripts.chat_completion", vision_ckpt, "--max_gen_len", 2, "--max_seq_len", 512)
    assert got.returncode == 0, got.stderr
    assert got.stdout.count("> Assistant:") == 5
    assert "User: <image><image>Write a haiku that brings both images together" in got.stdout


def test_bad_image_input_is_one_line_and_exit_2(run_script, vision_ckpt, tiny_ckpt, pictures, tmp_path, dist1):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a picture")
    assert_user_error(run_script("scripts.chat_completion", vision_ckpt, "--prompt", "hi", "--image", notes),
                      "not an image format")
    # The other cases in-process (run_cli turns these errors into the same one line and exit 2).
    with pytest.raises(FlagError, match="vision tower.*text only"):
        chat_completion.main(str(tiny_ckpt), prompt="hi", image=[str(pictures[0])])
    with pytest.raises(FlagError, match="--image goes with --prompt"):
        chat_completion.main(str(vision_ckpt), image=str(pictures[0]))
    with pytest.raises(PromptError, match=r"image\(s\).*max_seq_len 64"):
        chat_completion.main(str(vision_ckpt), prompt="hi", image=[str(p) for p in pictures] * 4, max_seq_len=64,
                             max_gen_len=2)


def test_random_checkpoint_with_a_vision_tower(run_script, tmp_path):
    out = tmp_path / "v-hf"
    got = run_script("scripts.random_checkpoint", out, "--vision", "--format", "hf")
    assert got.returncode == 0 and "with a vision tower" in got.stdout, got.stderr
    args = read_model_args(out)
    assert args.vision_args is not None and args.vision_args.image_size == VISION_ARGS["image_size"]
    names = Checkpoint(out, args).keys()
    assert "vision_projection.weight" in names
    assert "vision_embeddings.vision_encoder.transformer.resblocks.1.attn.wq.bias" in names
