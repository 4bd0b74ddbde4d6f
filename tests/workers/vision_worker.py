"""Helper of test_vision_parallel.py (not a test): under torchrun, the logits and greedy reply of a
two-image dialog at the launched world size, saved by rank 0.

    python -m torch.distributed.run --nproc-per-node 2 tests/workers/vision_worker.py CKPT OUT
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llama_lite import Llama4  # noqa: E402
from scripts.chat_completion import image_dialog  # noqa: E402


def probe(llama: Llama4) -> dict:
    inp = llama.formatter.encode_dialog(image_dialog())
    tokens = torch.tensor([inp.tokens])
    logits = llama.model(tokens, 0, **llama.image_inputs(tokens, [[t.tiles for t in inp.images]]))
    reply = llama.generate_tokens([inp.tokens], images=[[t.tiles for t in inp.images]], temperature=0, max_gen_len=6,
                                  stop_tokens=[])[0]
    return {"logits": logits, "reply": reply, "world_size": llama.world_size}


if __name__ == "__main__":
    llama = Llama4.build(sys.argv[1], max_seq_len=256, max_batch_size=1, dtype=torch.float32)
    result = probe(llama)
    if torch.distributed.get_rank() == 0:
        torch.save(result, sys.argv[2])
    torch.distributed.destroy_process_group()
