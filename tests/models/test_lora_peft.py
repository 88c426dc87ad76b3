"""LoRA adapters on the embedded SmolLM2-135M (real weights) against HF + PEFT: adapters made
with `peft`, read by Prism, decoded greedily through the paged path; each adapter's tokens are
those of PEFT's merge_and_unload model, and one batch of 8 adapters and the base gives every
request the tokens it gets alone."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.embedded import embedded_model_dir
from models.loader import ModelSource, load_model
from models.lora import NO_ADAPTER, LoraSlots, read_adapter
from models.tokenizer import load_tokenizer
from prism_server import envs
from tests.models.lora_cases import Request, Spec, greedy, make_adapters, merged_logits

# measured on the 2-core machine: the module about 35 s when it is idle, minutes when it is
# shared (as tests/models/test_real_weights.py); the fast tier runs the same paths on tiny
# models against PEFT (tests/models/test_lora.py)
pytestmark = pytest.mark.slow

NEW_TOKENS = 10
NEAR_TIE = 1e-3
LOGIT_TOL = 2e-3  # fp32, the delta as two GEMMs against the merged weight's one
SPECS = {  # every target module unless said; B ~ N(0, std)
    "r8": Spec(r=8, alpha=16),
    "r16-rslora": Spec(r=16, alpha=8, extra=(("use_rslora", True),)),
    "r4": Spec(r=4, alpha=8, std=0.04),
    "r32": Spec(r=32, alpha=16),
    "r8-qv": Spec(r=8, alpha=16, targets=("q_proj", "v_proj"), std=0.05),
    "r8-patterns": Spec(
        r=8,
        alpha=16,
        extra=(("rank_pattern", {"down_proj": 4}), ("alpha_pattern", {"o_proj": 32})),
    ),
    "r2-mlp": Spec(r=2, alpha=4, targets=("gate_proj", "up_proj", "down_proj"), std=0.05),
    "r16": Spec(r=16, alpha=16),
}
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite book is",
    "To make a cup of tea, first",
    "The largest planet in the solar system",
    "In 1969, the first person to walk on the moon",
]
CASES = [*SPECS, None]  # None: the base


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """(Prism's model, HF's, the prompts' ids, the adapters' directories): loaded once."""
    path = embedded_model_dir("smollm2-135m", envs.gguf_cache_dir())
    ours = load_model(ModelSource("hf", str(path))).model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = load_tokenizer(path)
    prompts = [tok(p).input_ids for p in PROMPTS]
    dirs = make_adapters(hf, SPECS, tmp_path_factory.mktemp("adapters"))
    return ours, hf, prompts, dirs


@pytest.fixture(scope="module")
def slots(smol):
    """The 8 adapters read by Prism, in slots 0..7 of the base's LoraSlots."""
    ours, _, _, dirs = smol
    s = LoraSlots(ours, num_slots=8)
    for i, name in enumerate(SPECS):
        s.assign(i, read_adapter(dirs[name], ours).weights)
    return s


_alone: dict[str | None, tuple[list[int], torch.Tensor]] = {}


def alone(smol, slots, case: str | None):
    """A case's request decoded alone (cached for the module): (tokens, logits)."""
    if case not in _alone:
        ours, _, prompts, _ = smol
        i = CASES.index(case)
        slot = NO_ADAPTER if case is None else i
        toks, logits = greedy(ours, slots, [Request(prompts[i], slot)], NEW_TOKENS)
        _alone[case] = (toks[0], logits[0])
    return _alone[case]


@pytest.mark.parametrize("case", CASES, ids=[c or "base" for c in CASES])
def test_greedy_tokens_equal_peft_merged(smol, slots, case):
    ours, hf, prompts, dirs = smol
    prompt = prompts[CASES.index(case)]
    tokens, logits = alone(smol, slots, case)
    ref = merged_logits(hf, None if case is None else dirs[case], prompt + tokens)
    ref = ref[len(prompt) - 1 : -1]  # HF's next-token logits along our sequence
    for step, t in enumerate(tokens):
        best = int(ref[step].argmax())
        if t != best:  # allowed only where the reference itself sees a near-tie
            gap = float(ref[step, best] - ref[step, t])
            assert gap < NEAR_TIE, f"{case} step {step}: ours {t}, PEFT {best}, gap {gap}"
            break  # past a tie the continuations legitimately differ
        diff = float((logits[step] - ref[step]).abs().max())
        assert diff < LOGIT_TOL, f"{case} step {step}: logits differ by {diff}"
    if case is not None:  # the adapter matters: the base's logits are elsewhere
        base = merged_logits(hf, None, prompt + tokens)[len(prompt) - 1 : -1]
        assert float((base - ref).abs().max()) > 0.5


def test_a_batch_of_8_adapters_and_the_base_gives_each_its_tokens_alone(smol, slots):
    """Nine requests (8 adapters, the base) and a second one of adapter r8: some join two
    steps late (their prefill beside the others' decodes), the two r8 requests apart in the
    batch (that slot's tokens gathered, not a range)."""
    ours, _, prompts, _ = smol
    requests = [
        Request(prompts[i], NO_ADAPTER if c is None else i, start=0 if i % 2 else 2)
        for i, c in enumerate(CASES)
    ]
    requests.append(Request(prompts[4], 0, start=0))  # r8 again, on another prompt
    tokens, logits = greedy(ours, slots, requests, NEW_TOKENS)
    for case, got, lg in zip(CASES, tokens, logits):
        want, want_logits = alone(smol, slots, case)
        assert got == want, f"{case}: batched {got}, alone {want}"
        assert torch.allclose(lg, want_logits, atol=1e-3, rtol=0)
    extra, _ = greedy(ours, slots, [Request(prompts[4], 0)], NEW_TOKENS)
    assert tokens[-1] == extra[0]
