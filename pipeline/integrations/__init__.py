"""Hooks for other people's training loops (each module imports its framework lazily)."""
