"""One node, several devices (issue 41 part 3): ``load_model(folder, device_map=...)`` on the CPU.
This machine has no second device, so the split is accelerate's: ``max_memory`` gives the CPU
room for about half the weights and the rest is offloaded to disk (kept on the meta device and
brought in block by block as the forward pass reaches it). ``find_massive`` must give the same
entries as the model loaded whole, on the bridge and on the nnsight backend."""

from __future__ import annotations

import pytest
import torch
from accelerate import infer_auto_device_map, init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM

from massive_lens import find_massive, load_model
from massive_lens.core.budget import weight_bytes
from massive_lens.core.model_view import ModelView
from massive_lens.core.tokens import byte_tokenizer
from massive_lens.models.tiny import tiny_config

TEXTS = ["The cat sat on the mat. Then it slept.", "Hi there"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny llama saved with save_pretrained, a massive value planted at BOS (dim 3)."""
    tok = byte_tokenizer()
    cls, config = tiny_config("llama", tok, {})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = cls(config)
    with torch.no_grad():
        hf.get_input_embeddings().weight[tok.bos_token_id, 3] = 400.0
    path = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return path, weight_bytes(hf)


def split_map(path, size: int) -> dict:
    """accelerate's device map for a CPU with room for half the weights, the rest on disk."""
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return infer_auto_device_map(empty, max_memory={"cpu": size // 2, "disk": 10 * size},
                                 no_split_module_classes=["LlamaDecoderLayer"])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("backend", ["bridge", "nnsight"])
def test_split_over_two_devices_same_entries(folder, backend):
    path, size = folder
    device_map = split_map(path, size)
    assert set(device_map.values()) == {"cpu", "disk"}  # two devices' worth: the split is real
    whole = find_massive(load_model(str(path), backend=backend), TEXTS)
    model = load_model(str(path), device_map=device_map, backend=backend)
    hf = getattr(model, "original_model", None) or ModelView(model).hf
    assert any(p.device.type == "meta" for p in hf.parameters())  # the disk half is not in memory
    split = find_massive(model, TEXTS)
    assert len(whole.to_frame()) > 0
    assert whole.to_frame().equals(split.to_frame())
    assert whole.magnitudes.equals(split.magnitudes)
