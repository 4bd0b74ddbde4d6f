"""quantization.build(..., int8_activations=True): int4 layers multiply int8 activations (per 32
values) on every CPU path, as the reference does, and the option is refused where it cannot apply."""

import pytest
import torch

import kernels
import quantization
from kernels import cpu
from kernels import reference as R
from llama_lite.errors import ConfigError
from quantization.modules import QuantizedExperts, QuantizedFeedForward, QuantizedLinear


def _int4_weights(model):
    return [w for m in model.modules() for w in vars(m).values() if isinstance(w, kernels.Int4Weight)]


def _layer_checks(model, errors):
    """Hooks comparing each quantized layer's CPU result with the reference's on its real input."""

    def check(name):
        def hook(mod, args):
            if isinstance(mod, QuantizedLinear):
                got, ref = cpu.linear(args[0], mod.weight), R.linear(args[0], mod.weight)
            elif isinstance(mod, QuantizedFeedForward):
                got, ref = cpu.swiglu(args[0], mod.w1, mod.w3, mod.w2), R.swiglu(args[0], mod.w1, mod.w3, mod.w2)
            else:
                x, offsets = args[0], args[1]
                got = cpu.grouped_swiglu(x, offsets, mod.w1, mod.w3, mod.w2)
                ref = R.grouped_swiglu(x, offsets, mod.w1, mod.w3, mod.w2)
            errors.append((name, ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()))

        return hook

    kinds = (QuantizedLinear, QuantizedFeedForward, QuantizedExperts)
    return [m.register_forward_pre_hook(check(n)) for n, m in model.named_modules() if isinstance(m, kinds)]


@pytest.mark.parametrize("isa", cpu.cpu_isas())
def test_every_layer_matches_the_reference_and_logits_stay_near_int4(isa, tiny_ckpt, dist1):
    prompt = [1, 500, 1000, 1500, 2000, 2500, 3000, 3500]
    kw = dict(targets="all", max_seq_len=64, max_batch_size=1, progress=False, dtype=torch.float32)
    cpu.set_isa(isa)
    try:
        a8 = quantization.build(tiny_ckpt, "int4_mixed", int8_activations=True, **kw)
        weights = _int4_weights(a8.model)
        assert weights and all(w.int8_activations for w in weights) and a8.int8_activations
        errors = []
        hooks = _layer_checks(a8.model, errors)
        try:  # prefill rows (8 per call), then a decode row
            got = a8.model.forward(torch.tensor([prompt]), start_pos=0)
            a8.model.forward(torch.tensor([[42]]), start_pos=len(prompt))
        finally:
            for h in hooks:
                h.remove()
        # each layer: the reference's numbers up to fp32 summation order (whole-model logits can
        # differ more: a 1e-7 change upstream may move an activation across an int8 rounding
        # boundary, one step of 1/127 of its block's largest value)
        assert len(errors) > 20 and max(e for _, e in errors) <= 1e-5, max(errors, key=lambda t: t[1])
        base = quantization.build(tiny_ckpt, "int4_mixed", **kw).model.forward(torch.tensor([prompt]), start_pos=0)
        rel = ((got - base).norm() / base.norm()).item()
        assert 0 < rel < 0.05, rel  # int8 activations per 32 values add little to int4's own error
        assert len(a8.generate_tokens([prompt], max_gen_len=4, temperature=0)[0]) == 4
    finally:
        cpu.set_isa(None)


def test_refused_without_int4_weights(tiny_ckpt, dist1):
    with pytest.raises(ConfigError, match="int4"):
        quantization.build(tiny_ckpt, "fp8_mixed", int8_activations=True, max_seq_len=64, max_batch_size=1,
                           progress=False)
