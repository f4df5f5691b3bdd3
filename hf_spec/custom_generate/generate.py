"""hf_spec's exact speculative decoding as a transformers ``custom_generate`` recipe.

    >>> import hf_spec
    >>> model.generate(**inputs, assistant_model=draft, custom_generate=hf_spec.CUSTOM_GENERATE, trust_remote_code=True)

transformers loads this file from the folder it is given (this package's folder, or a Hub repository holding the
same ``custom_generate/`` folder) and calls ``generate(model=..., ...)`` with every argument of the call. The model is
made `hf_spec.speculative` in place (its weights untouched; the same as calling ``speculative(model)`` yourself), so
assisted decoding, this call and later ones, is hf_spec's exact loop, with ``speculative_stats`` in the output.
"""

from hf_spec import speculative


def generate(model, *args, **kwargs):
    return speculative(model).generate(*args, **kwargs)
