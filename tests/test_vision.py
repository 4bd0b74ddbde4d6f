"""The vision tower, image preprocessing, image tokens and early fusion against Meta's reference
(llama-models, run on CPU) and Hugging Face's Llama4ForConditionalGeneration, on the same synthetic weights."""

import io
import json

import pytest
import torch
from PIL import Image, ImageDraw

from helpers import make_checkpoint
from llama_lite.chat_format import ChatFormat, RawMediaItem, RawMessage, RawTextItem
from llama_lite.errors import PromptError
from llama_lite.generation import Llama4
from llama_lite.image_transform import load_image, transform_image
from llama_lite.synthetic import VISION_ARGS

pytest.importorskip("llama_models")

TOL = 0.03  # bf16 rounding of O(1) logits, as in test_model_reference
# The reference's temperature tuning breaks its bf16 run (see test_model_reference); it is off here.
OVERRIDES = dict(vision_args=VISION_ARGS, attn_temperature_tuning=False)


def picture(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A drawn test image: a gradient with a few shapes (no file is downloaded or shipped)."""
    g = torch.Generator().manual_seed(seed)
    colour = lambda: tuple(int(c) for c in torch.randint(0, 256, (4 if mode == "RGBA" else 3,), generator=g))  # noqa: E731
    img = Image.new(mode, (width, height), colour())
    draw = ImageDraw.Draw(img)
    for i in range(6):
        x0, y0 = int(torch.randint(0, width, (1,), generator=g)), int(torch.randint(0, height, (1,), generator=g))
        box = [x0, y0, x0 + width // 3, y0 + height // 3]
        (draw.ellipse if i % 2 else draw.rectangle)(box, fill=colour())
    return img


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vision_meta(ckpt_root):
    return make_checkpoint(ckpt_root, "vision-meta", preset="tiny", seed=5, overrides=OVERRIDES)


@pytest.fixture(scope="module")
def vision_hf(ckpt_root):
    return make_checkpoint(ckpt_root, "vision-hf", preset="tiny", seed=5, fmt="hf", overrides=OVERRIDES)


@pytest.fixture(scope="module")
def ours(vision_meta, dist1):
    return {dtype: Llama4.build(vision_meta, max_seq_len=256, max_batch_size=2, dtype=dtype)
            for dtype in (torch.float32, torch.bfloat16)}


def meta_args(path, max_seq_len=256):
    from llama_models.llama4.args import ModelArgs as RefArgs

    return RefArgs(**json.loads((path / "params.json").read_text()), max_seq_len=max_seq_len, max_batch_size=2)


def meta_model(path, dtype):
    """llama-models' multimodal Transformer on the CPU (its KV caches call .cuda(), made a no-op)."""
    from llama_models.llama4.model import Transformer as RefTransformer

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        ref = RefTransformer(meta_args(path))
    finally:
        torch.set_default_dtype(old)
    missing, unexpected = ref.load_state_dict(torch.load(path / "consolidated.00.pth", weights_only=True), strict=False)
    assert not unexpected and not [m for m in missing if "cache" not in m]
    return ref.to(dtype).eval()


def hf_model(path, dtype):
    from safetensors.torch import load_file
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    cfg = json.loads((path / "config.json").read_text())
    text = {k: v for k, v in cfg["text_config"].items() if k not in ("model_type", "torch_dtype")}
    vision = {k: v for k, v in cfg["vision_config"].items() if k != "model_type"}
    rest = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype", "text_config",
                                                      "vision_config")}
    config = Llama4Config(text_config=text, vision_config=vision, **rest)
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "sdpa"
    # Built in the target dtype: .to() would cast the vision RoPE's complex buffer to real.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Llama4ForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(old)
    missing, unexpected = model.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
    assert not missing and not unexpected
    return model


@pytest.fixture(scope="module")
def refs(vision_meta, vision_hf):
    """refs(dtype) -> (llama-models' model, transformers' model), each built once per dtype."""
    built = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)

        def get(dtype):
            if dtype not in built:
                built[dtype] = (meta_model(vision_meta, dtype), hf_model(vision_hf, dtype))
            return built[dtype]

        yield get


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# --- the encoder, adapter and projection -------------------------------------------------------
TILE_CASES = {"one_tile": picture(40, 30, seed=1), "grid_2x2_and_thumbnail": picture(100, 100, seed=2)}


@pytest.mark.parametrize("case", list(TILE_CASES))
def test_vision_tower_matches_llama_models_and_transformers(case, ours, vision_hf, refs):
    image = transform_image(TILE_CASES[case], VISION_ARGS["image_size"], max_num_chunks=16)
    assert image.tiles.shape[0] == (1 if case == "one_tile" else 5)
    ours_hf = Llama4.build(vision_hf, max_seq_len=64, max_batch_size=1, dtype=torch.float32)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        got = ours[dtype].model.encode_images(image.tiles)
        meta, hf = refs(dtype)
        with torch.no_grad():
            ve = meta.vision_embeddings
            want_meta = meta.vision_projection(ve.vision_adapter(ve.vision_encoder(image.tiles.to(dtype)[:, None])))
            feats = hf.vision_model(image.tiles.to(dtype)).last_hidden_state
            want_hf = hf.multi_modal_projector(feats.reshape(-1, feats.shape[-1]))
        want_meta = want_meta.reshape(want_hf.shape)
        assert got.shape == want_hf.shape == (image.tiles.shape[0] * 4, 128)
        assert rel_err(got, want_meta) <= tol, (dtype, rel_err(got, want_meta))
        assert rel_err(got, want_hf) <= tol, (dtype, rel_err(got, want_hf))
        if dtype == torch.float32:  # the same weights read from the Hugging Face layout
            assert torch.equal(ours_hf.model.encode_images(image.tiles), got)


# --- preprocessing --------------------------------------------------------------------------------
def meta_transform(img: Image.Image, size: int, max_num_chunks: int):
    from llama_models.llama4.chat_format import convert_image_to_rgb
    from llama_models.llama4.preprocess import ResizeNormalizeImageTransform, VariableSizeImageTransform

    img = convert_image_to_rgb(img)
    tiles, grid = VariableSizeImageTransform(size)(img, max_num_chunks=max_num_chunks)
    if tiles.shape[0] > 1:
        tiles = torch.cat([tiles, ResizeNormalizeImageTransform(size, size)(img)[None]])
    return tiles, grid


# (width, height, colour mode, tile size, max_num_chunks): wide, tall, square, tiny, upscaled and
# downscaled images; tie-breaking between canvases; transparency and palette / grey modes.
PIXEL_CASES = [(40, 30, "RGB", 56, 16), (30, 200, "RGBA", 56, 16), (300, 90, "P", 56, 4), (150, 151, "L", 56, 16),
               (1000, 20, "RGB", 56, 16), (7, 7, "RGBA", 112, 16), (448, 336, "RGB", 112, 4), (200, 90, "RGB", 56, 1),
               (130, 257, "RGB", 112, 5), (112, 112, "RGBA", 56, 4)]


def test_pixels_equal_llama_models_transform():
    for i, (w, h, mode, size, max_num_chunks) in enumerate(PIXEL_CASES):
        img = picture(w, h, seed=i, mode="RGBA" if mode == "RGBA" else "RGB")
        if mode in ("L", "P"):
            img = img.convert(mode)
        want, grid = meta_transform(img.copy(), size, max_num_chunks)
        got = transform_image(load_image(png_bytes(img)), size, max_num_chunks)
        assert got.grid == grid, PIXEL_CASES[i]
        assert torch.equal(got.tiles, want), PIXEL_CASES[i]
    assert len({g for g in (transform_image(picture(w, h, 0), s, c).grid for w, h, _, s, c in PIXEL_CASES)}) >= 5


def test_image_sources_agree_and_alpha_lies_over_white(tmp_path):
    img = Image.new("RGBA", (20, 10), (255, 0, 0, 0))  # fully transparent red
    path = tmp_path / "clear.png"
    img.save(path)
    decoded = [load_image(x) for x in (img, png_bytes(img), path, str(path), open(path, "rb"))]
    assert all(d.mode == "RGB" and d.tobytes() == decoded[0].tobytes() for d in decoded)
    assert decoded[0].getpixel((3, 3)) == (255, 255, 255)


# --- chat format --------------------------------------------------------------------------------
def dialogs(images: list[Image.Image]):
    """The same dialogs for both formatters: ours (first) and llama-models' (second)."""
    from llama_models.datatypes import RawMediaItem as RefMedia, RawMessage as RefMessage, RawTextItem as RefText

    data = [png_bytes(i) for i in images]
    one = [("user", [data[0], "What is in this picture?"])]
    two = [
        ("system", "Answer in one line."),
        ("user", [data[0], data[1], "Write a haiku that brings both images together"]),
        ("assistant", "Two worlds, one frame."),
        ("user", ["And this one?", data[2]]),
    ]

    def build(spec, msg, media, text):
        return [msg(role=r, content=c if isinstance(c, str) else
                    [media(data=x) if isinstance(x, bytes) else text(text=x) for x in c]) for r, c in spec]

    return [(build(d, RawMessage, RawMediaItem, RawTextItem), build(d, RefMessage, RefMedia, RefText))
            for d in (one, two)]


@pytest.fixture(scope="module")
def formatters(vision_meta):
    from llama_models.llama4.chat_format import ChatFormat as RefChatFormat
    from llama_models.llama4.tokenizer import Tokenizer as RefTokenizer
    from llama_lite.checkpoint import read_model_args
    from llama_lite.tokenizer import Tokenizer

    ours = ChatFormat(Tokenizer.from_default(), vision_args=read_model_args(vision_meta).vision_args)
    return ours, RefChatFormat(RefTokenizer.get_instance(), vision_args=meta_args(vision_meta).vision_args)


IMAGES = [picture(100, 100, seed=3), picture(40, 130, seed=4), picture(250, 60, seed=5)]


def test_image_dialog_tokens_and_pixels_equal_llama_models(formatters):
    ours, ref = formatters
    for mine, theirs in dialogs(IMAGES):
        got, want = ours.encode_dialog(mine), ref.encode_dialog_prompt(theirs)
        assert got.tokens == want.tokens
        assert len(got.images) == len(want.images) == sum(isinstance(i, RawMediaItem) for m in mine
                                                          for i in (m.content if isinstance(m.content, list) else []))
        for a, b in zip(got.images, want.images):
            assert torch.equal(a.tiles, b)
    grids = [ours.encode_image(png_bytes(i))[1].grid for i in IMAGES]
    assert len(set(grids)) == 3  # three different tile layouts were covered


def test_max_num_chunks_bounds_the_tiles(formatters):
    ours, _ = formatters
    fmt = ChatFormat(ours.tokenizer, ours.vision_args, max_num_chunks=2)
    tokens, image = fmt.encode_image(IMAGES[0])
    assert image.tiles.shape[0] <= 3
    assert tokens.count(ours.tokenizer.special_tokens["<|patch|>"]) == image.tiles.shape[0] * 4


# --- early fusion: whole-dialog logits -----------------------------------------------------------
def test_dialog_logits_match_llama_models_and_transformers(ours, refs):
    """fp32: all three agree to 1e-4. bf16: within bf16 rounding of Meta's reference, and no farther
    from transformers than Meta's reference itself is (transformers' bf16 vision tower rounds differently)."""
    from llama_models.llama4.datatypes import MaskedEmbedding, TransformerInput

    for dtype in (torch.float32, torch.bfloat16):
        llama = ours[dtype]
        inp = llama.formatter.encode_dialog(dialogs(IMAGES)[0][0])
        tokens = torch.tensor([inp.tokens])
        tiles = [t.tiles for t in inp.images]
        got = llama.model(tokens, 0, **llama.image_inputs(tokens, [tiles]))
        meta, hf = refs(dtype)
        mask = (tokens == llama.tokenizer.special_tokens["<|patch|>"])[..., None]
        with torch.no_grad():
            emb = MaskedEmbedding(embedding=meta.vision_embeddings([tiles], mask, meta.tok_embeddings(tokens)), mask=mask)
            want_meta = meta(TransformerInput(tokens=tokens, tokens_position=0, image_embedding=emb)).logits.float()
            want_hf = hf_dialog_logits(hf, tokens, torch.cat(tiles).to(dtype))
        if dtype == torch.float32:
            assert rel_err(got, want_meta) <= 1e-4 and rel_err(got, want_hf) <= 1e-4
            assert torch.equal(got.argmax(-1), want_meta.argmax(-1))
        else:  # bf16 logits of 202k tokens have near-ties, so argmax equality is not asked for here
            ulp = 2.0 ** (torch.log2(want_meta.abs().max()).floor().item() - 7)
            assert (got - want_meta).abs().max().item() <= 2 * ulp
            assert rel_err(got, want_hf) <= 1.1 * rel_err(want_meta, want_hf) + 1e-3
        # The images matter: without them the same tokens give other logits.
        assert (llama.model(tokens, 0) - got).abs().max().item() > 10 * TOL


def hf_dialog_logits(hf, tokens, pixel_values):
    """Llama4ForConditionalGeneration.forward's own steps (its forward, in transformers 5.x, fails
    assembling its output object after computing the logits): embed, encode the images, project,
    scatter into the placeholder tokens, run the language model."""
    embeds = hf.get_input_embeddings()(tokens)
    feats = hf.vision_model(pixel_values).last_hidden_state
    projected = hf.multi_modal_projector(feats.reshape(-1, feats.shape[-1])).to(embeds.dtype)
    embeds = embeds.masked_scatter(hf.get_placeholder_mask(tokens, embeds, projected), projected)
    return hf.language_model(inputs_embeds=embeds, use_cache=False).logits.float()


def test_mixed_batch_rows_equal_each_dialog_alone(ours):
    llama = ours[torch.float32]
    text_only = [RawMessage(role="user", content="Tell me about boats.")]
    with_images = dialogs(IMAGES)[1][0]
    batch = llama.generate_tokens(
        [llama.formatter.encode_dialog(d).tokens for d in (text_only, with_images)],
        images=[[], [t.tiles for t in llama.formatter.encode_dialog(with_images).images]],
        temperature=0, max_gen_len=6, stop_tokens=[],
    )
    alone = [list(s) for s in (
        _greedy(llama, [text_only]), _greedy(llama, [with_images]),
    )]
    assert batch == [alone[0][0], alone[1][0]]


def _greedy(llama, dialogs_):
    out = [[] for _ in dialogs_]
    for step in llama.chat_completion(dialogs_, temperature=0, max_gen_len=6, stop_tokens=[]):
        for r in step:
            if not r.ignore_token:
                out[r.batch_idx].append(r.token)
    return out


# --- bad input ----------------------------------------------------------------------------------
def test_bad_images_are_one_sentence_errors(ours, tmp_path, tiny_llama, monkeypatch):
    from PIL import ImageFile

    # Importing llama-models' preprocessing (earlier tests) makes Pillow accept truncated files process-wide.
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", False)
    llama = ours[torch.float32]
    text = tmp_path / "notes.txt"
    text.write_text("not an image")
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(png_bytes(IMAGES[0])[:200])
    cases = {
        text: "not an image format", truncated: "cannot read", tmp_path / "missing.png": "does not exist",
        b"\x00\x01": "not an image format", 3.5: "must be bytes, a file path or a PIL image",
    }
    for data, words in cases.items():
        with pytest.raises(PromptError, match=words):
            next(llama.chat_completion([[RawMessage(role="user", content=[RawMediaItem(data=data)])]], max_gen_len=1))
    many = [RawMessage(role="user", content=[RawMediaItem(data=i) for i in IMAGES * 4])]
    with pytest.raises(PromptError, match=r"image\(s\).*max_seq_len 256"):
        next(llama.chat_completion([many], max_gen_len=1))
    with pytest.raises(PromptError, match="no vision tower"):
        next(tiny_llama.chat_completion([[RawMessage(role="user", content=[RawMediaItem(data=IMAGES[0])])]]))
