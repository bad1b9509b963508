"""The pieces of benchmarks/README.md: `templates/` (the text of every section), `template`
(the template mechanism), `derived` (the figures the result files do not hold) and `machine`
(the machine of a file). `python benchmarks/make_readme.py` renders the page; the modules import
each other relatively, so that the benchmark scripts in benchmarks/ are never shadowed.
"""
