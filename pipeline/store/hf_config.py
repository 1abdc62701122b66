"""What fullece reads from a Hugging Face model's configuration (no torch, no weights)."""

from __future__ import annotations


def vocab_size_of(config: dict, head_rows: int | None = None):
    """K, the width of the model's logits rows: the one rule for every stage.

    The rows of the output head when its weights are loaded (``fullece
    extract``): that is the width the logits have, even where a head padded
    beyond the tokenizer makes it differ from config.json. Otherwise (``fullece
    import``, which loads no weights) config.json's ``vocab_size``, or its
    ``text_config.vocab_size`` (multimodal models). Returns the value as found
    (None when absent): callers check it and name their own file in the error.
    """
    if head_rows is not None:
        return int(head_rows)
    k = config.get("vocab_size")
    if k is None and isinstance(config.get("text_config"), dict):
        k = config["text_config"].get("vocab_size")
    return k
