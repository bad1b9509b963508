"""The pieces of benchmarks/README.md, built from the result files in benchmarks/results/.

`python benchmarks/make_readme.py` is the entry point; this package holds what it renders, read
top to bottom: `format` (numbers, markdown tables, prose filling), `machine` (the machine a file
was measured on), one module per benchmark script (`attention`, `flash`, `gpu`, `models`,
`decode`) with the prose of its method and the tables of its figures, and `page`, which puts
the sections together. The modules import each other relatively, so that the benchmark scripts
of the same names in benchmarks/ are never shadowed.
"""
