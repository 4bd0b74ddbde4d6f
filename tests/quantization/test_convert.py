"""convert_to_quantized_model: each mode against bf16 with dequantized weights, tensor
parallelism, targets, memory, llama-models' pre-quantized layout and errors."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, make_checkpoint, mapping_flags, resident_bytes, same_routing, worker_results
from kernels import cpu
from kernels.formats import dequantize_weight
from kernels.memory import thp_enabled
from llama_lite.checkpoint import Checkpoint, write_meta_checkpoint
from llama_lite.errors import CheckpointError, ConfigError
from llama_lite.generation import Llama4
from quantization import build
from quantization.convert import _plan, _weights_of, quantize_weight
from quantization.modes import MODE_FORMAT, QuantizationMode, parse_targets
from quantization.modules import QuantizedExperts, QuantizedFeedForward, QuantizedLinear


MODES = ["int4_mixed", "fp8_mixed", "w4a8", "nvfp4"]
TOKENS = torch.randint(0, 200000, (2, 12), generator=torch.Generator().manual_seed(0))


def dequantized_checkpoint(src, dst, mode: str, targets=None):
    """The same model with every targeted weight replaced by its dequantized value, in bf16."""
    ck = Checkpoint(src)
    sd = {k: ck.get(k).clone() for k in ck.keys()}
    with torch.device("meta"):
        from llama_lite.model import Transformer

        model = Transformer(ck.args)
    m = QuantizationMode(mode)
    for path, kind in _plan(model, parse_targets(m, targets), m):
        for pname, _, transposed in _weights_of(kind):
            name = f"{path}.{pname}"
            w = sd[name].transpose(-1, -2) if transposed else sd[name]
            deq = dequantize_weight(quantize_weight(w, MODE_FORMAT[m]))  # fp32: exact
            sd[name] = deq.transpose(-1, -2).contiguous() if transposed else deq
    write_meta_checkpoint(dst, json.loads((src / "params.json").read_text()), [sd])
    shutil.copyfile(src / "tokenizer.model", dst / "tokenizer.model")
    return dst


# Both models run in fp32 and the reference holds the exact dequantized weights, so weight-only
# formats differ only by summation order (1e-3 on O(1) logits). Formats that also quantize
# activations to fp8 (3 mantissa bits: rounding error up to 6.25%, ~3.6% RMS per element) do so
# at both expert matmuls of every layer, which the residual stream carries to the logits:
# measured ~6% RMS on this model, bounded here by 10%.
TOLERANCE = {"int4_mixed": (1e-3, 1e-4), "nvfp4": (1e-3, 1e-4), "fp8_mixed": (None, 0.10), "w4a8": (None, 0.10)}


_REFERENCE_LOGITS: dict = {}


@pytest.mark.parametrize("isa", cpu.cpu_isas())
@pytest.mark.parametrize("mode", MODES)
def test_matches_bf16_with_dequantized_weights(mode, isa, tiny_ckpt, ckpt_root, dist1):
    """Under every CPU cap this machine can run: one tolerance for all paths."""
    if mode not in _REFERENCE_LOGITS:
        ref_dir = ckpt_root / f"deq-{mode}"
        if not ref_dir.exists():
            dequantized_checkpoint(tiny_ckpt, ref_dir, mode)
        _REFERENCE_LOGITS[mode] = Llama4.build(ref_dir, max_seq_len=64, max_batch_size=2, dtype=torch.float32).model(TOKENS, 0)
    ref = _REFERENCE_LOGITS[mode]
    cpu.set_isa(isa)
    try:
        got = build(tiny_ckpt, mode, max_seq_len=64, max_batch_size=2, progress=False, dtype=torch.float32).model(TOKENS, 0)
    finally:
        cpu.set_isa(None)
    max_abs, rel_rms = TOLERANCE[mode]
    rel = ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    assert rel <= rel_rms, rel
    if max_abs is not None:
        assert (got - ref).abs().max().item() <= max_abs


def test_modules_swapped_per_mode(tiny_ckpt, dist1):
    int4 = build(tiny_ckpt, "int4_mixed", max_seq_len=32, max_batch_size=1, progress=False).model
    assert all(isinstance(b.feed_forward.experts, QuantizedExperts) for b in int4.layers)
    assert all(isinstance(b.feed_forward.shared_expert, QuantizedFeedForward) for b in int4.layers)
    fp8 = build(tiny_ckpt, "fp8_mixed", max_seq_len=32, max_batch_size=1, progress=False).model
    kinds = [isinstance(b.feed_forward.experts, QuantizedExperts) for b in fp8.layers]
    assert kinds == [False, True, True, False]  # first and last layers stay bf16, as the reference
    every = build(tiny_ckpt, "int4_mixed", targets="all", max_seq_len=32, max_batch_size=2, progress=False).model
    assert isinstance(every.layers[0].attention.wq, QuantizedLinear) and isinstance(every.output, QuantizedLinear)
    assert every(TOKENS, 0).isfinite().all()


def test_bf16_layers_run_on_the_kernels_gemv_with_the_same_numbers(tiny_ckpt, dist1):
    """On a CPU in bf16 the layers a mode leaves unquantized (linear layers, dense SwiGLUs, routed
    experts in mode none) run through kernels.linear. Where PyTorch's bf16 GEMM is native (AVX512-BF16,
    AMX) prefill takes it and equals the core's layers exactly; elsewhere prefill rows go through the
    GEMV or fp32 tiles. Everywhere: within bf16 rounding and with the same argmax, the kernel model
    routing as the core did (helpers.same_routing; its own choice may differ only at a near-tie)."""
    from functools import partial

    from quantization.convert import convert_to_quantized_model
    from quantization.modules import KernelExperts, KernelFeedForward, KernelLinear

    for mode in ("none", "int4_mixed"):
        fast = build(tiny_ckpt, mode, max_seq_len=32, max_batch_size=2, progress=False).model
        assert isinstance(fast.layers[0].attention.wq, KernelLinear) and isinstance(fast.output, KernelLinear)
        if mode == "none":
            moe = fast.layers[1].feed_forward
            assert isinstance(moe.experts, KernelExperts) and isinstance(moe.shared_expert, KernelFeedForward)
        loader = partial(convert_to_quantized_model, quantization_mode=mode, progress=False, prepare=False)
        core = Llama4.build(tiny_ckpt, max_seq_len=32, max_batch_size=2, convert=loader).model
        assert not isinstance(core.layers[0].attention.wq, KernelLinear)
        for layer in core.layers:  # the same prefill attention on both sides: this test is about the linear layers
            layer.attention.prefill_attend_impl = fast.layers[0].attention.prefill_attend_impl
        with same_routing(fast, core) as flips:
            tokens = TOKENS[:2, :9]
            b, a = core(tokens, 0), fast(tokens, 0)
            if cpu.native_bf16() and cpu.isa() != "avx2":
                assert torch.equal(a, b)
            assert (a - b).abs().max().item() <= 0.05 * b.abs().max().item()
            assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9
            for pos in range(9, 12):
                step = TOKENS[:2, pos : pos + 1]
                b, a = core(step, pos), fast(step, pos)
                assert (a - b).abs().max().item() <= 0.05 * b.abs().max().item()
                assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert all(margin <= 0.02 for _, margin in flips), flips


def test_prefill_attention_kernel_in_the_model(tiny_ckpt, dist1):
    """Under the avx512 cap the loader's model prefills through kernels.prefill_attention, also a
    prefill that continues a cached one across the tiny preset's 8-token chunks (its ring-cache
    masks); the logits are those of the same model with SDPA within bf16 rounding (SDPA rounds its
    softmax weights to bf16), the second model routing as the first (helpers.same_routing: a top-1
    near-tie can go either way within that rounding)."""
    if "avx512" not in cpu.cpu_isas():
        pytest.skip("this CPU cannot run the avx512 path")
    import kernels

    cpu.set_isa("avx512")
    try:
        fast, slow = (build(tiny_ckpt, "none", max_seq_len=32, max_batch_size=2, progress=False).model for _ in "ab")
        assert all(layer.attention.prefill_attend_impl is kernels.prefill_attention for layer in fast.layers)
        calls = []

        def counted(*args):
            out = kernels.prefill_attention(*args)
            calls.append(out is not None)
            return out

        for layer_f, layer_s in zip(fast.layers, slow.layers):
            layer_f.attention.prefill_attend_impl, layer_s.attention.prefill_attend_impl = counted, None
        with same_routing(slow, fast) as flips:
            for start, end in ((0, 5), (5, 12)):  # the second attends to cached keys too
                a = fast(TOKENS[:2, start:end], start)
                b = slow(TOKENS[:2, start:end], start)
                assert (a - b).abs().max().item() <= 0.05 * b.abs().max().item()
                assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9
        assert len(calls) == 2 * len(fast.layers) and all(calls)
        assert all(margin <= 0.02 for _, margin in flips), flips
    finally:
        cpu.set_isa(None)


@pytest.mark.slow
def test_tensor_parallel_gives_the_same_tokens(tiny_ckpt, tmp_path):
    """TP=2 vs TP=1 (both fp32, so only the quantization can differ).

    Weights are quantized whole and sliced, so weight-only formats give the same tokens. Formats
    that quantize activations per token compute that scale on each rank's slice of a row-parallel
    layer's input (as Meta's reference and vLLM do under TP): their logits agree closely, but not
    bit for bit, so greedy tokens may part after a near tie."""
    for isa in cpu.cpu_isas():  # every CPU cap this machine can run (LLAMA_LITE_CPU_ISA in the ranks)
        one = worker_results(tmp_path, tiny_ckpt, ",".join(MODES), 1, isa=isa)
        two = worker_results(tmp_path, tiny_ckpt, ",".join(MODES), 2, isa=isa)
        for mode in ("int4_mixed", "nvfp4"):
            assert two[mode]["greedy"] == one[mode]["greedy"], (isa, mode)
            assert (two[mode]["logits"] - one[mode]["logits"]).abs().max().item() <= 1e-3, (isa, mode)
        for mode in ("fp8_mixed", "w4a8"):
            a, b = two[mode]["logits"], one[mode]["logits"]
            assert ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item() <= 0.05, (isa, mode)
            assert two[mode]["greedy"][0][:2] == one[mode]["greedy"][0][:2], (isa, mode)


@pytest.mark.parametrize("fmt", ["int4", "fp8", "w4a8", "nvfp4"])
def test_large_weights_quantize_in_row_blocks_to_the_same_values(fmt, monkeypatch):
    """A tall matrix quantizes in blocks of rows (temporaries of one block, in cache); the blocks,
    the last one short, give exactly what quantizing it in one block gives."""
    import quantization.formats as formats
    from quantization.sharding import tensor_fields

    w = (torch.randn(5 * 48 + 7, 256) * torch.logspace(-3, 1, 5 * 48 + 7).unsqueeze(1)).to(torch.bfloat16)
    monkeypatch.setattr(formats, "BLOCK_VALUES", w.numel())
    whole = quantize_weight(w, fmt)
    monkeypatch.setattr(formats, "BLOCK_VALUES", 48 * 256)
    blocks = []
    real = formats._row_blocks
    monkeypatch.setattr(formats, "_row_blocks", lambda t: blocks.append(len(real(t))) or real(t))
    pieces = quantize_weight(w, fmt)
    assert blocks == [6]
    assert type(pieces) is type(whole)
    for name, t in tensor_fields(whole).items():
        assert torch.equal(getattr(pieces, name), t), name


def test_group_size_must_divide(tiny_ckpt, dist1):
    with pytest.raises(ConfigError, match="group size 96 does not divide"):
        build(tiny_ckpt, "int4_mixed", group_size=96, max_seq_len=32, max_batch_size=1, progress=False)


def test_unknown_mode_and_target(tiny_ckpt, dist1):
    with pytest.raises(ConfigError, match="unknown quantization mode"):
        build(tiny_ckpt, "int3", max_seq_len=32, max_batch_size=1)
    with pytest.raises(ConfigError, match="unknown quantization target"):
        build(tiny_ckpt, "int4_mixed", targets="experts,lm_head", max_seq_len=32, max_batch_size=1)


MEMORY_PROBE = r"""
import sys, threading, time, json
sys.path.insert(0, {root!r})
import torch
from llama_lite.distributed import init_distributed
init_distributed(1, "cpu")
import quantization

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def anon():
    return status("RssAnon:")
peak = [0]
stop = False
def watch():
    while not stop:
        peak[0] = max(peak[0], anon()); time.sleep(0.002)
from llama_lite.tokenizer import Tokenizer
Tokenizer({ckpt!r} + "/tokenizer.model")  # cached: its BPE tables are not model memory
base, base_rss = anon(), status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # restart VmHWM (all resident pages, file-backed too)
t = threading.Thread(target=watch, daemon=True); t.start()
llama = quantization.build({ckpt!r}, "int4_mixed", max_seq_len=16, max_batch_size=1, progress=False)
stop = True; t.join()
hwm = status("VmHWM:")
from quantization.modules import model_weight_bytes
stored, _ = model_weight_bytes(llama.model)
kv = sum(l.attention.cache_k.nbytes + l.attention.cache_v.nbytes for l in llama.model.layers
         if l.attention.cache_k is not None)
from quantization.sharding import tensor_fields
from kernels.formats import QuantizedWeight
large = [t for m in llama.model.modules() for w in vars(m).values() if isinstance(w, QuantizedWeight.__args__)
         for t in tensor_fields(w).values() if t.nbytes >= 2**21]
print(json.dumps({{"base": base, "peak": peak[0], "end": anon(), "stored": stored, "rss_grew": hwm - base_rss,
                  "kv": kv, "large": len(large), "aligned": sum(t.data_ptr() % 2**21 == 0 for t in large),
                  "table_aligned": llama.model.tok_embeddings.weight.data_ptr() % 2**21 == 0}}))
"""


@pytest.mark.slow
def test_int4_load_never_holds_the_bf16_model(ckpt_root):
    """Peak memory while converting the small preset: the loaded model and little more.

    The bf16 files are memory-mapped (page cache, not copies); what the process allocates is the
    int4 experts, the bf16 parts the mode keeps (copied into huge pages: the embedding table and
    the output layer), one layer in flight, and what the C heap keeps of freed transients (the
    loader trims it after each layer: ~30 MiB over the model remain on this preset, 45-56 MiB
    without the trim, which before hid behind the output layer staying a view). A loader that held
    every layer's bf16 experts would need their 52 MiB more than this bound allows."""
    ckpt = make_checkpoint(ckpt_root, "small", preset="small", mp=1, seed=0)
    state = torch.load(ckpt / "consolidated.00.pth", mmap=True, weights_only=True)
    n_layers = json.loads((ckpt / "params.json").read_text())["n_layers"]
    expert_bytes_per_layer = sum(t.numel() * 2 for k, t in state.items() if "experts" in k or "shared" in k) / n_layers
    table_bytes = state["tok_embeddings.weight"].numel() * 2
    del state
    proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE.format(root=str(ROOT), ckpt=str(ckpt))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = m["peak"] - m["base"]
    allowance = 64 * 2**20
    assert expert_bytes_per_layer * n_layers > allowance - 30 * 2**20  # the bound would see the bf16 experts
    # Nothing beyond the loaded model (int4 + its bf16 parts) and the allowance.
    assert grown <= m["stored"] + allowance, (grown, m["stored"])
    # All resident pages, the memory-mapped bf16 files' included: the loader drops each layer's
    # bf16 pages once quantized, and a tensor's once copied, so file pages beyond the anonymous
    # peak stay within about one layer's experts (without the release they grow to every layer's)
    # plus one large bf16 tensor's pages (the embedding table's or the output layer's, each 40% of
    # this preset): it is read once through its mapping to be copied, so for that moment its pages
    # and its copy are both resident.
    file_pages = m["rss_grew"] - grown
    assert file_pages <= 2 * expert_bytes_per_layer + table_bytes + 8 * 2**20, (file_pages, expert_bytes_per_layer)
    assert m["rss_grew"] <= m["stored"] + m["kv"] + table_bytes + allowance, (m["rss_grew"], m["stored"], m["kv"])
    # The embedding table (copied, not mapped) lies in 2 MiB-aligned memory advised for huge pages
    # (kernels.memory), and so do any quantized tensors of 2 MiB or more (none on this preset).
    # (where transparent huge pages are off, nothing is copied for them: kernels.memory.thp_enabled)
    assert m["aligned"] == m["large"] and m["table_aligned"] == HUGE, m


# Whether this machine gives advised memory huge pages; where not, the loader copies nothing for them.
HUGE = thp_enabled()


def _advised(t: torch.Tensor) -> bool:
    """t starts on a 2 MiB boundary of memory advised for huge pages (the smaps flag ``hg``)."""
    from kernels.memory import HUGE_PAGE

    return t.data_ptr() % HUGE_PAGE == 0 and any("hg" in f for _, _, f in mapping_flags(t))


def test_weights_that_run_on_the_cpu_lie_in_huge_pages(tiny_ckpt):
    """Tensors of 2 MiB or more that decode reads go to memory advised for 2 MiB pages: quantized
    ones, and bf16 ones too, copied out of the memory-mapped checkpoint (whose page cache lies in
    4 KiB pages) with the checkpoint's values; smaller bf16 tensors stay views of it."""
    from kernels.memory import HUGE_PAGE

    raw = Checkpoint(tiny_ckpt)
    llama = build(tiny_ckpt, "int4_mixed", targets="output", max_seq_len=16, max_batch_size=1)
    out_w = llama.model.output.weight.qweight
    assert out_w.nbytes >= HUGE_PAGE and _advised(out_w) == HUGE
    assert _advised(llama.model.tok_embeddings.weight) == HUGE
    wq = llama.model.layers[0].attention.wq.weight
    assert wq.nbytes < HUGE_PAGE and not _advised(wq)
    assert torch.equal(llama.model.tok_embeddings.weight, raw.get("tok_embeddings.weight"))
    # the output layer left in bf16 (the mode's default targets): copied into huge pages
    llama = build(tiny_ckpt, "int4_mixed", max_seq_len=16, max_batch_size=1)
    out_bf16 = llama.model.output.weight
    assert out_bf16.dtype == torch.bfloat16 and out_bf16.nbytes >= HUGE_PAGE and _advised(out_bf16) == HUGE
    assert torch.equal(out_bf16, raw.get("output.weight"))


def test_large_copies_drop_the_file_pages_of_each_copied_chunk(tmp_path, monkeypatch):
    """A bf16 weight copied out of the memory-mapped checkpoint gives back each chunk's file pages as
    it goes, so the file's pages and the copy are never both held whole (the load's peak was ~0.8
    GiB over the model on the bench preset, two 0.8 GB tables); the copy has the file's values."""
    import mmap

    import kernels.memory as M
    from llama_lite.checkpoint import release_file_pages

    mib = 1 << 20
    path = tmp_path / "table.bin"
    want = torch.randn(8 * mib // 2).to(torch.bfloat16)
    path.write_bytes(want.view(torch.uint8).numpy().tobytes())
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    src = torch.frombuffer(mapped, dtype=torch.bfloat16).view(4096, -1)
    resident = []

    class Source:  # the loader's source: drops the pages of the checkpoint's files in a range
        def release(self, within=None):
            release_file_pages([path], within)
            resident.append(resident_bytes(src.data_ptr(), src.data_ptr() + src.nbytes))

    monkeypatch.setattr(M, "COPY_CHUNK", mib)
    source = Source()
    out = M.huge_page_copy(src, copied=lambda start, end: source.release(within=(start, end)))
    assert torch.equal(out, want.view(4096, -1))
    assert _advised(out) == HUGE
    if HUGE:  # copied chunk by chunk: never more than about a chunk of the file resident
        assert len(resident) == 8 and max(resident) <= 2 * mib, resident
    del src
    mapped.close()


def test_bf16_routed_experts_are_laid_out_in_huge_pages():
    """Routed experts left in bf16 are copied once, transposed to nn.Linear orientation, straight
    into memory advised for huge pages (no second copy); small ones into PyTorch's allocator."""
    from quantization.convert import _linear_layout

    w = torch.randn(4, 1024, 512).to(torch.bfloat16)  # [E, D, F]: 4 MiB
    t = _linear_layout(w)
    assert t.shape == (4, 512, 1024) and t.is_contiguous() and _advised(t) == HUGE
    assert all(torch.equal(t[e], w[e].T) for e in range(4))
    small = _linear_layout(w[:, :64, :64])
    assert torch.equal(small, w[:, :64, :64].transpose(1, 2)) and not _advised(small)


def llama_models_layout(src, dst, mp: int):
    """Lay a bf16 checkpoint out the way llama-models' quantize script writes int4_mixed: routed
    experts of every MoE layer but the first and last packed (two int4 per byte, low nibble
    first, scale = amax / 8 per 128 inputs), transposed back to [E, D, F], flattened to 2-D and
    viewed as float8_e4m3fn; scales in int4_scales_N.pt as [E, K/128, N] per rank."""
    from kernels.formats import pack_int4

    dst.mkdir(parents=True)
    ck = Checkpoint(src)
    n_layers = ck.args.n_layers
    for rank in range(mp):
        shard = Checkpoint(src, world_size=mp, rank=rank)
        raw = torch.load(src / "consolidated.00.pth", weights_only=True) if mp == 1 else None
        from llama_lite.synthetic import to_meta_keys

        engine = {k: shard.get(k).clone() for k in shard.keys()}
        scales = {}
        quantized = {}
        for i in range(1, n_layers - 1):
            for which in ("w1", "w3", "w2"):
                name = f"layers.{i}.feed_forward.experts.{which}"
                w = engine[name].transpose(1, 2).float()  # [E, N, K]
                e, n, k = w.shape
                groups = w.reshape(e, n, k // 128, 128)
                s = groups.abs().amax(-1, keepdim=True).clamp(min=1e-6) / 8
                q = (groups / s).round().clamp(-8, 7).to(torch.int8).reshape(e, n, k)
                packed = pack_int4(q).view(torch.int8)  # [E, N, K/2]
                quantized[name] = packed.transpose(1, 2).contiguous()  # [E, K/2, N]
                scales[name] = s.reshape(e, n, k // 128).transpose(1, 2).contiguous()  # [E, K/128, N]
        meta = to_meta_keys(engine, ck.args)
        for name, packed in quantized.items():
            key = {"w1": "moe_w_in_eD_F", "w3": "moe_w_swiglu_eD_F", "w2": "moe_w_out_eF_D"}[name.rsplit(".", 1)[1]]
            meta[name.rsplit(".", 1)[0] + "." + key] = packed.reshape(-1, packed.shape[-1]).view(torch.float8_e4m3fn)
        torch.save(meta, dst / f"consolidated.{rank:02d}.pth")
        torch.save(scales, dst / f"int4_scales_{rank}.pt")
        del raw
    shutil.copyfile(src / "params.json", dst / "params.json")
    shutil.copyfile(src / "tokenizer.model", dst / "tokenizer.model")
    return dst


@pytest.mark.parametrize("mp", [1, 2])
def test_loads_llama_models_int4_layout(mp, ckpt_root, dist1):
    src = make_checkpoint(ckpt_root, f"tiny-mp{mp}", preset="tiny", mp=mp, seed=0)
    dst = ckpt_root / f"lm-int4-mp{mp}"
    if not dst.exists():
        llama_models_layout(src, dst, mp)
    ours = build(dst, "int4_mixed", max_seq_len=32, max_batch_size=2, progress=False)
    experts = ours.model.layers[1].feed_forward.experts
    # The loaded int4 values equal the reference's own quantization of the bf16 weights.
    w = Checkpoint(src).get("layers.1.feed_forward.experts.w1").transpose(1, 2).float()
    groups = w.reshape(*w.shape[:2], -1, 128)
    s = groups.abs().amax(-1, keepdim=True).clamp(min=1e-6) / 8
    want = ((groups / s).round().clamp(-8, 7) * s).reshape(w.shape)
    assert torch.equal(dequantize_weight(experts.w1), want)
    assert ours.model(TOKENS, 0).isfinite().all()
    with pytest.raises(CheckpointError, match="int4_mixed"):
        build(dst, "fp8_mixed", max_seq_len=32, max_batch_size=2, progress=False)
