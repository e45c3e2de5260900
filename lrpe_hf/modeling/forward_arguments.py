"""The keyword arguments a model's forward takes beyond its named ones, across transformers releases.

transformers hands a model more than its named arguments (the Trainer's ``num_items_in_batch``, ``generate``'s
``cache_position``), and it renames them between releases: 5.24 passes the generation cache as ``cache`` where
earlier releases said ``past_key_values`` (and recurrent models ``cache_params``). A forward that swallowed an
argument it does not understand would decode without its past, or ignore a mask, and say nothing. So every
forward hands its ``**kwargs`` to ``take_cache`` and ``check_extra_arguments``: the names below are taken or
checked, and any other name raises, naming it.
"""

from dataclasses import fields

from transformers.modeling_outputs import BaseModelOutputWithPast

# The names a generation cache has gone by, newest first.
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")

# The output field that carries the cache in the installed release ("cache" from 5.24 on).
OUTPUT_FIELDS = {field.name for field in fields(BaseModelOutputWithPast)}
CACHE_OUTPUT_FIELD = "cache" if "cache" in OUTPUT_FIELDS else "past_key_values"

# What a causal-LM loss takes from the Trainer: the token count over a whole accumulated batch, and labels
# already shifted (context parallelism) with their ignore index.
LOSS_ARGUMENTS = frozenset({"num_items_in_batch", "shift_labels", "ignore_index"})

# Passed by transformers and meaningless here, each for its reason:
# - cache_position: the slots of the new tokens in a key-value cache; a recurrent state has no slots, and the
#   cache counts every row's real tokens itself.
# - tokenizer: generate's own (it decodes stop strings), which generate hands on to the model with its inputs.
NEUTRAL_ARGUMENTS = frozenset({"cache_position", "tokenizer"})


def take_cache(kwargs: dict, **named):
    """The generation cache under whichever name it came: ``named`` holds the forward's own cache arguments
    (``past_key_values``, ``cache``), ``kwargs`` may hold the others (``cache_params``), which are removed from it.
    Two names given at once raise. (Written in the plain Python that torch 2.7's compiler traces.)"""
    given = {name: value for name, value in named.items() if value is not None}
    for name in CACHE_ARGUMENTS:
        if name in kwargs:
            value = kwargs.pop(name)
            if value is not None:
                given[name] = value
    if len(given) > 1:
        raise ValueError(f"Pass the cache once: got {' and '.join(sorted(given))}")
    for value in given.values():
        return value
    return None


# What transformers' DataCollatorWithFlattening adds for flash attention (return_flash_attn_kwargs=True) and for
# recurrent kernels (return_seq_idx=True): the documents of a packed row, which these models read from its
# position_ids (a position that does not grow starts a document), which the collator returns by default.
PACKING_ARGUMENTS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})


def check_extra_arguments(model, kwargs: dict, accepted=frozenset()):
    """Raise on any keyword argument of ``model.forward`` that is neither named in its signature, nor in
    ``accepted`` (the ones its loss uses), nor neutral."""
    unknown = sorted(set(kwargs) - NEUTRAL_ARGUMENTS - accepted)
    packing = [name for name in unknown if name in PACKING_ARGUMENTS]
    if packing:
        raise TypeError(
            f"{type(model).__name__}.forward got {', '.join(packing)}, which mark packed documents for flash "
            "attention or recurrent kernels. These models read packed rows from position_ids alone (a position that "
            "does not grow starts a document): use DataCollatorWithFlattening() without return_flash_attn_kwargs "
            "or return_seq_idx (it returns position_ids by default)."
        )
    if unknown:
        raise TypeError(
            f"{type(model).__name__}.forward got argument(s) it does not use: {', '.join(unknown)}. It refuses them "
            "rather than ignore them, since an argument that carries inputs or state (a cache, positions, a mask) "
            "would otherwise be lost without a word. If a transformers release passes this name, please report it "
            "with your transformers version."
        )
