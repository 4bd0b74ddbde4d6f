"""Two ranks generate together; rank 1 dies abruptly mid-way. Rank 0 must not hang."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llama_lite.generation import Llama4  # noqa: E402


def main(ckpt: str) -> None:
    llama = Llama4.build(ckpt, max_seq_len=256, max_batch_size=1, world_size=2)
    for i, _ in enumerate(llama.generate([[200000, 1, 2, 3]], temperature=0, max_gen_len=200, stop_tokens=[])):
        if i == 5 and llama.rank == 1:
            os._exit(17)  # no cleanup, as a crash or the OOM killer would do
    print("rank", llama.rank, "finished without its peer", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
