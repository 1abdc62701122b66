"""Sliding windows over a long document (the usual strided-perplexity scheme).

A document of T <= max_length tokens is one window scoring offsets 1..T-1.
A longer one is covered by windows starting every `stride` tokens; each window
scores only the offsets the previous one did not reach, so every token from
the second on is scored exactly once, with the longest context the window
allows.
"""

from __future__ import annotations


def plan_windows(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """[(begin, end, first), ...]: window tokens [begin, end) score offsets [first, end)."""
    if not 1 <= stride < max_length:
        raise ValueError(
            f"need 1 <= stride < max_length, got stride={stride}, max_length={max_length}"
        )
    if n_tokens < 2:
        return []
    windows = []
    prev_end = 1  # offset 0 is never scored
    begin = 0
    while True:
        end = min(begin + max_length, n_tokens)
        windows.append((begin, end, prev_end))
        if end >= n_tokens:
            return windows
        prev_end = end
        begin += stride
