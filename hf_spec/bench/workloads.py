"""What `hf-spec bench` runs on: HumanEval code, prose chat requests, and an input-copying edit task.

- ``code``: HumanEval prompts, to complete as plain text;
- ``prose``: chat requests for prose (`PROSE_PROMPTS`);
- ``edit``: chat requests to add type hints to a given HumanEval solution (the answer copies much of the input).

Requests are chat messages where the tokenizer has a chat template. Models without a tokenizer (the tiny pair) get
random ids under the same names (`random_workloads`).
"""

from __future__ import annotations

import torch

from hf_spec.checks import check_int
from hf_spec.loading.corpora import humaneval_problems

WORKLOADS = ("code", "prose", "edit")

PROSE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a curious ten-year-old why the sky is blue and sunsets are red.",
    "Write a friendly letter to a neighbour inviting them to a garden party next Saturday.",
    "Describe a busy morning market in a small coastal town, with its sounds and smells.",
    "Summarise the main causes of the French Revolution in a few paragraphs.",
    "Give advice to someone starting their first job about managing their time.",
    "Write a product description for a handmade wooden chess set.",
    "Tell the story of how tea spread from China to the rest of the world.",
)

EDIT_REQUEST = "Add type hints to this Python function. Reply with the complete rewritten function only.\n\n"


def text_workloads(tokenizer, names: tuple[str, ...], num_prompts: int,
                   offset: int = 0) -> dict[str, list[dict[str, torch.Tensor]]]:
    """``code``: HumanEval prompts, to complete as plain text; ``prose``: `PROSE_PROMPTS`; ``edit``: add type hints to
    HumanEval solutions. ``num_prompts`` of each from ``offset`` on (hold out what a draft was trained on). Requests
    are chat messages (plain text without a chat template)."""
    check_int("offset", offset, minimum=0)
    for name in names:
        available = {"prose": len(PROSE_PROMPTS)}.get(name) or (len(humaneval_problems()) if name in WORKLOADS else 0)
        if name in WORKLOADS and offset + num_prompts > available:
            raise ValueError(f"The {name} workload has {available} prompts; `offset` + `num_prompts` is "
                             f"{offset + num_prompts}.")
    selected = slice(offset, offset + num_prompts)
    workloads = {}
    for name in names:
        if name == "code":
            texts = [problem["prompt"] for problem in humaneval_problems()[selected]]
        elif name == "prose":
            texts = [_as_chat(tokenizer, text) for text in PROSE_PROMPTS[selected]]
        elif name == "edit":
            texts = [
                _as_chat(tokenizer, f"{EDIT_REQUEST}```python\n{problem['prompt']}{problem['canonical_solution']}```")
                for problem in humaneval_problems()[selected]
            ]
        else:
            raise ValueError(f"Unknown workload {name!r}; choose from {WORKLOADS}.")
        workloads[name] = [dict(tokenizer(text, return_tensors="pt", add_special_tokens=False)) for text in texts]
    return workloads


def random_workloads(names: tuple[str, ...], num_prompts: int, vocab_size: int, seed: int = 0) -> dict:
    """Random-id prompts (lengths 4 to 11) under each workload name, for models without a tokenizer."""
    generator = torch.Generator().manual_seed(seed)
    workloads = {}
    for name in names:
        lengths = torch.randint(4, 12, (num_prompts,), generator=generator).tolist()
        workloads[name] = [{"input_ids": torch.randint(1, vocab_size, (1, n), generator=generator),
                            "attention_mask": torch.ones(1, n, dtype=torch.long)} for n in lengths]
    return workloads




def _as_chat(tokenizer, text: str) -> str:
    if not tokenizer.chat_template:
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
