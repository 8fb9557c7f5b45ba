"""Atropos groups (`atroposlib`'s `ScoredDataGroup`, one per line of JSON Lines) in and out.

A file of groups is read as precompute's rows, line by line; a cache's or a scored file's rows are written back as
the groups they came from, every other byte of each line kept, and can be posted to an Atropos API server as an
environment does. Pure Python, numpy and pyarrow: both stages import this, and nothing here imports torch.
docs/development.md maps the modules.
"""
