"""Per-op placement rules, one module per op family. Importing this package registers them all.

* ``elementwise`` — unary/binary math, comparisons, where, masked_fill, copies and casts
* ``reduction``   — sum, mean, amax, max, any, var_mean, prod, cumsum, ...
* ``norm``        — softmax / log_softmax, native_layer_norm
* ``matmul``      — mm, bmm, addmm, baddbmm, mv, dot, matmul, linear (one einsum-style helper)
* ``shape``       — view/reshape (local "shape" rewrite), expand, permute, transpose, (un)squeeze
* ``indexing``    — select, slice, index_select, gather, index, cat, stack, split, pad, getitem
* ``embedding``   — embedding, vocab-parallel lookup (local "vocab_parallel" rewrite)
* ``attention``   — every scaled_dot_product attention overload
* ``creation``    — factories, *_like, new_*
* ``random``      — rand_like, bernoulli, native_dropout (local "rank_rng" rewrite on shards)
"""

from autotp.ops import (  # noqa: F401
    attention,
    creation,
    elementwise,
    embedding,
    indexing,
    matmul,
    norm,
    random,
    reduction,
    registry,
    shape,
)
