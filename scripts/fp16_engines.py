"""precision_check's float16 verdict on tiny random-weight models of the families vLLM refuses in
float16 (vllm/config/model.py, ``_FLOAT16_NOT_SUPPORTED_MODELS``), next to two it runs, built as
the architecture matrix builds them (tests/matrix.py). Run from the repository root:

    nice -n 5 .venv/bin/python scripts/fp16_engines.py
"""

import sys
import warnings

sys.path.insert(0, "tests")
warnings.simplefilter("ignore")

from matrix import Unbuildable, tiny_hf  # noqa: E402

from massive_lens.handover import precision_check  # noqa: E402
from massive_lens.models import byte_tokenizer, wrap_hf_model  # noqa: E402

FAMILIES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "glm4": "Glm4ForCausalLM",
            "plamo2": "Plamo2ForCausalLM", "llama (control)": "LlamaForCausalLM", "qwen2 (control)": "Qwen2ForCausalLM"}
for family, arch in FAMILIES.items():
    try:
        model = wrap_hf_model(tiny_hf(arch), byte_tokenizer(), name=f"tiny-{arch}")
    except (Unbuildable, AttributeError, Exception) as exc:  # noqa: BLE001 - report what could not be built
        print(f"| {family} | {arch} | not built: {type(exc).__name__}: {str(exc).splitlines()[0][:80]} |")
        continue
    check = precision_check(model, "Some text to read, and more of it. " * 10, seq_len=16, n_seqs=2,
                            dtypes=("float16",))
    v = check.verdicts.iloc[0]
    peak = check.peaks[check.peaks["kind"] != "scores"]["max_abs"].max()
    print(f"| {family} | {arch} | {v.verdict} | {peak:,.1f} | x{v.ppl_ratio:.4f} | {v.smallest_fix} |")
