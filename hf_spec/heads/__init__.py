"""Draft heads: small drafts that read the target's hidden states (EAGLE-style).

- `model`: `DraftHead` and `DraftHeadConfig`, a transformers model (``save_pretrained`` / ``from_pretrained``, and
  ``AutoModel`` once this package is imported);
- `training`: the training set of target features (``datasets``, cached on disk) and `train_head` (``Trainer``);
- `drafter`: `HeadDrafter` and `HeadTreeDrafter`, what runs a head inside the loop; ``generate(assistant_model=head)``
  builds one through `DraftHead.hf_spec_drafter` (`hf_spec.drafting.base.DraftSource`).
"""

from transformers import AutoConfig, AutoModel

from hf_spec.heads.model import DraftHead, DraftHeadConfig

AutoConfig.register(DraftHeadConfig.model_type, DraftHeadConfig, exist_ok=True)
AutoModel.register(DraftHeadConfig, DraftHead, exist_ok=True)

__all__ = ["DraftHead", "DraftHeadConfig"]
