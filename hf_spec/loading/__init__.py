"""Models for the loop: the tiny random pair, real models from pinned wheels, quantization, and compatible pairs.

- `tiny`: random-weight Llamas for tests and instant demos;
- `pretrained`: real models that work offline (verified, converted once, cached), `load`;
- `quantization`: bitsandbytes schemes, and the check of what this CPU can run in 4 bits;
- `pair`: `load_pair`, a target and a draft that fit each other, loaded, quantized and placed.
"""

from hf_spec.loading.pair import Pair, load_pair

__all__ = ["Pair", "load_pair"]
