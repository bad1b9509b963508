"""The pieces of benchmarks/README.md: `template` (the template mechanism), `values` (numbers,
dtypes, the machine of a file), `sections`, `decoding` and `real_model` (each section's figures
and table rows), and `templates/` (the text of every section). `python benchmarks/make_readme.py`
renders the page; the modules import each other relatively, so that the benchmark scripts in
benchmarks/ are never shadowed.
"""
