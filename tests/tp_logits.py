"""Helper of test_tensor_parallel.py (not a test): logits of fixed inputs, saved by rank 0.

    python -m torch.distributed.run --nproc-per-node 2 tests/tp_logits.py OUT_DIR NAME=CKPT:DTYPE ...

For each case it builds the checkpoint at the launched world size, runs ``probe`` and saves
OUT_DIR/NAME.pt. The test runs the same ``probe`` in one process and compares.
"""

import gc
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llama_lite import Llama4  # noqa: E402

# Two rows of different lengths (the second padded), then decode steps at each row's own position;
# the decode inputs are fixed so runs compare step by step even where rounding flips an argmax.
PROMPTS = [[200000, 791, 6864, 315, 9822, 374, 12366, 13, 578, 6864], [200000, 40, 1093, 1317, 11]]
DECODE_TOKENS = [[1820, 2001], [374, 13], [264, 7]]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(ckpt, dtype: str) -> Llama4:
    return Llama4.build(ckpt, max_seq_len=64, max_batch_size=2, dtype=DTYPES[dtype])


def probe(llama: Llama4) -> dict:
    """Prefill logits [2, S, V], decode logits [2, 3, V] and 8 greedy tokens of the first prompt."""
    model = llama.model
    width = max(len(p) for p in PROMPTS)
    batch = torch.tensor([p + [llama.tokenizer.pad_id] * (width - len(p)) for p in PROMPTS])
    pos = torch.tensor([len(p) for p in PROMPTS])
    prefill = model(batch, 0, lengths=pos)  # padding is not stored: it would overwrite a chunked layer's ring
    # logits at padding positions are meaningless (they see whatever the cache held before): not compared
    prefill = prefill.masked_fill(torch.arange(width).view(1, -1, 1) >= pos.view(-1, 1, 1), 0.0)
    decode = []
    for tokens in DECODE_TOKENS:
        decode.append(model(torch.tensor(tokens).view(2, 1), pos)[:, 0])
        pos = pos + 1
    greedy = llama.generate_tokens([PROMPTS[0]], temperature=0, max_gen_len=8, stop_tokens=[])[0]
    return {"prefill": prefill, "decode": torch.stack(decode, 1), "greedy": greedy, "world_size": llama.world_size}


def main(out_dir: str, *cases: str) -> None:
    for case in cases:
        name, _, rest = case.partition("=")
        ckpt, _, dtype = rest.rpartition(":")
        llama = build(ckpt, dtype)
        result = probe(llama)
        if torch.distributed.get_rank() == 0:
            torch.save(result, Path(out_dir) / f"{name}.pt")
        del llama, result
        gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
