"""The pure metric core: binning, additive bin tables, the streaming accumulator,
metric formulas, input checks and the bootstrap. No I/O, no torch at import."""
