"""Atropos groups (`atroposlib`'s `ScoredDataGroup`, one per line of JSON Lines) in and out.

reader.py reads a file of groups as precompute's rows, line by line; groups.py reads a group into klpipe's rows
and fills one back in; writer.py writes a cache's or a scored
file's rows back as groups; post.py posts them to an Atropos API server as an environment does.
Pure Python, numpy and pyarrow: both stages import this, and nothing here imports torch.
"""
