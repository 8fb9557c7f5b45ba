"""How klpipe runs attention exactly, without pads: rows packed end to end, and a chunk's prefix tree.

Packed rows run whole, each row's attention alone; the tree runs every distinct prefix once, continuing its
ancestors' keys and values (or recurrent states), and merges attention over a row's path by log-sum-exp.
docs/development.md maps the modules; docs/precompute.md says how it works.
"""
