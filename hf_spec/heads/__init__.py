"""Draft heads: small drafts that read the target's hidden states (EAGLE-style).

- `model`: `DraftHead` and `DraftHeadConfig`, a transformers model (``save_pretrained`` / ``from_pretrained``, and
  ``AutoModel`` once this package is imported);
- `training`: the training set of target features (``datasets``, cached on disk) and `train_head` (``Trainer``).

The drafter that runs a head inside the loop is `hf_spec.drafting.head.HeadDrafter`; ``generate(assistant_model=head)``
builds it.
"""

from transformers import AutoConfig, AutoModel

from hf_spec.heads.model import DraftHead, DraftHeadConfig

AutoConfig.register(DraftHeadConfig.model_type, DraftHeadConfig, exist_ok=True)
AutoModel.register(DraftHeadConfig, DraftHead, exist_ok=True)

__all__ = ["DraftHead", "DraftHeadConfig"]
