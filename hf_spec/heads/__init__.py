"""Draft heads: small drafts that read the target's hidden states (EAGLE-style).

- `base`: `DraftHeadBase`, the interface the loop and the trainer use;
- `model`: `DraftHead` and `DraftHeadConfig`, a transformers model (``save_pretrained`` / ``from_pretrained``, and
  ``AutoModel`` once this package is imported);
- `eagle3`: `Eagle3Head`, EAGLE-3, saved and loaded in the speculators format (`speculators`) that vLLM and SGLang
  serve;
- `saved`: which kind of head a folder holds, and loading it;
- `drafter`: `HeadDrafter` and `HeadTreeDrafter`, what runs a head inside the loop; ``generate(assistant_model=head)``
  builds one through `DraftHead.hf_spec_drafter` (`hf_spec.drafting.base.DraftSource`).
"""

from transformers import AutoConfig, AutoModel

from hf_spec.heads.eagle3 import Eagle3Head
from hf_spec.heads.model import DraftHead, DraftHeadConfig

AutoConfig.register(DraftHeadConfig.model_type, DraftHeadConfig, exist_ok=True)
AutoModel.register(DraftHeadConfig, DraftHead, exist_ok=True)

__all__ = ["DraftHead", "DraftHeadConfig", "Eagle3Head"]
