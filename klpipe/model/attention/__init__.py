"""How klpipe runs attention exactly, without pads: rows packed end to end, and a chunk's prefix tree.

packing.py        rows run whole end to end, each row's attention alone (windows as windows), no pad fed
pairs.py          the attention pairs kernels execute, per layer kind, from their own call arguments
tree.py           a chunk's prefix tree run pass by pass: every distinct prefix once
layered.py        a streamed tree's passes layer-major across its levels, each node's keys kept a layer at a time
continuation.py   what each kind of cache layer continues a prefix from (the table the tree reads)
context_cache.py  the cache a tree pass reads: each node's kept state, gathered or read in place
context_parts.py  which rows of a tree pass attend over which path nodes, in the order the cascade merges them
cascade.py        attention over a row's path where it lies, for the tree's full-attention layers
window_cascade.py the same for sliding-window layers: only the keys inside each query's window
lse_attention.py  attention that also returns its log-sum-exp, so that two parts of a row's keys merge exactly
"""
