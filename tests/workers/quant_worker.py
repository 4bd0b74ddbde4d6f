"""Run under torchrun (or alone): build each requested mode and save greedy tokens and prefill
logits from rank 0, so tests can compare world sizes and checkpoint layouts."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import quantization  # noqa: E402
from llama_lite.distributed import init_distributed  # noqa: E402


def main(ckpt: str, out: str, modes: str, world_size: int, targets: str = "", dtype: str = "fp32") -> None:
    """fp32 by default: bf16 all-reduces round partial sums differently at each world size, so
    greedy tokens are only comparable across world sizes in fp32."""
    rank, _ = init_distributed(int(world_size), "cpu")
    tokens = torch.randint(0, 200000, (2, 12), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode in modes.split(","):
        llama = quantization.build(ckpt, mode, targets=targets or None, max_seq_len=64, max_batch_size=2,
                                   world_size=int(world_size), progress=False,
                                   dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
        logits = llama.model(tokens, 0)
        greedy = llama.generate_tokens([[200000, 10, 20, 30], [200000, 5]], temperature=0, max_gen_len=12,
                                       stop_tokens=[])
        results[mode] = {"logits": logits, "greedy": greedy}
        del llama
    save_and_finish(rank, results, out)


def save_and_finish(rank: int, results: dict, out: str) -> None:
    """Rank 0 saves the results; every rank ends its process group."""
    if rank == 0:
        torch.save(results, out)
    # End the process group here, as the other workers and the scripts do, not in the interpreter's
    # exit: once in a full suite a rank of this worker aborted with "terminate called without an
    # active exception" (a C++ thread torn down unjoined), not reproduced in 8 runs since.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
