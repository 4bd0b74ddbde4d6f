"""Run under torchrun (or alone): decode one row in bf16 with the quantized loader's one-call
attention and MoE layers switched on, then off, and save rank 0's logits of each step and how many
layer steps the one-call layers took, so a test can compare the two under tensor parallelism."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import quantization  # noqa: E402
from llama_lite.distributed import init_distributed  # noqa: E402
from llama_lite.model import Attention, MoE  # noqa: E402
from quant_worker import save_and_finish  # noqa: E402  (this folder: the script's own)


def main(ckpt: str, out: str, modes: str, world_size: int) -> None:
    rank, _ = init_distributed(int(world_size), "cpu")
    prompt, nxt = torch.tensor([[200000, 10, 20, 30, 40]]), [42, 7, 99, 1234, 5, 600, 3, 8, 9, 10, 11]
    results = {}
    for mode in modes.split(","):
        llama = quantization.build(ckpt, mode, max_seq_len=64, max_batch_size=1, world_size=int(world_size),
                                   progress=False)  # fmt: skip
        model = llama.model
        layers = [m for m in model.modules() if isinstance(m, (Attention, MoE)) and m.one_token_impl is not None]
        impls = [m.one_token_impl for m in layers]
        taken = [0]

        def counted(impl):
            def call(*args):
                out = impl(*args)
                taken[0] += out is not None
                return out

            return call

        runs = {}
        for name, hooks in (("one_call", [counted(i) for i in impls]), ("separate", [None] * len(impls))):
            for m, h in zip(layers, hooks):
                m.one_token_impl = h
            model.setup_caches()
            with torch.inference_mode():
                model(prompt, 0)
                runs[name] = torch.cat([model(torch.tensor([[t]]), prompt.shape[1] + i)[:, -1]
                                        for i, t in enumerate(nxt)])  # fmt: skip
        # none: ranks reduce per layer (a one-call block, or all blocks in one call, would skip that)
        blocks = sum(b.one_token_impl is not None for b in model.layers) + (model.one_token_impl is not None)
        results[mode] = {**runs, "taken": taken[0], "expected": len(layers) * len(nxt), "blocks": blocks}
        del llama, model, layers, impls
    save_and_finish(rank, results, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
