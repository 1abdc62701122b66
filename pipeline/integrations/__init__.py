"""Hooks for other people's training loops (each module imports its framework lazily),
and what fullece reads of their models' configuration (hf_config)."""
