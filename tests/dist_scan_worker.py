"""Run by tests/test_distributed.py under torchrun: a scan with each rank on its shard."""

import json
import sys

import torch.distributed as dist

from massive_lens import Criterion, scan_corpus, tiny_model

CORPUS = ["Prose. With delimiters, and more prose.\n" * 10]
CRITERION = Criterion(abs_threshold=0.0, ratio_threshold=4.0)


def scan():
    return scan_corpus(tiny_model("llama"), CORPUS, seq_len=24, batch_size=2, criterion=CRITERION, progress=False)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    result = scan()
    out = {"rank": dist.get_rank(), "n_sequences": result.n_sequences, "n_tokens": result.n_tokens,
           "frequency": result.frequency.to_dict("list"), "profile": result.profile.to_dict("list")}
    with open(f"{sys.argv[1]}.{dist.get_rank()}.json", "w") as handle:
        json.dump(out, handle)
    dist.destroy_process_group()
