"""Benchmarks (issue 2 and after): ``python -m benchmarks.run_all --out DIR [--quick]``.

Each ``benchmarks/bench_*.py`` module runs on its own as
``python -m benchmarks.bench_NAME --out DIR [--quick]``, prints a readable
table and writes ``DIR/NAME.json``. See benchmarks/README.md.
"""
