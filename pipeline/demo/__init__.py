"""The default experiment: an offline corpus, a tiny GPT-2 trained on it, and
the paper's findings computed from its checkpoints (``make extract``/``make metrics``)."""
