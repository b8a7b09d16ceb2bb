"""Ground truth for the per-op placement rules (autotp/ops): every candidate a rule claims is run.

For each sample call (awkward sizes such as 6, 10, 12 and 3, world sizes 2 and 3) and every
combination of input placements — Replicate, Partial for floating tensors, Shard on each dim that
divides — the rule is asked for candidates. Each candidate is simulated with N ranks in one
process: Shard inputs are ``torch.chunk`` pieces, Replicate inputs the whole tensor, Partial inputs
N random summands; every rank runs the op on its pieces (through the registered local rewrite when
the candidate names one); the results are reassembled by the claimed output placement (Shard: cat,
Partial: sum, Replicate: all ranks must agree) and compared with the op on the whole inputs.

Tolerance: pure data movement without Partial must match exactly. Where Partial summands are
added, or where the local op computes on smaller blocks (matmuls, reductions, attention), fp32
reorders additions, so we allow ``rtol=1e-5, atol=1e-5`` (the values here are O(1)).

Random ops are run with the same seed on every rank and for the reference, which is how the
runtime keeps replicated random ops in sync. Candidates with the ``rank_rng`` rewrite (a shard draws
from its own stream) are checked for shapes and dtypes only; a test below checks that the ranks'
streams differ and follow the seed.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)
from torch.utils import _pytree as pytree

from autotp.ops import elementwise, registry
from autotp.ops.embedding import vocab_parallel_embedding
from autotp.ops.random import RANK_RNG
from autotp.ops.registry import Candidate, OpCall, Rejected, TensorSpec
from autotp.ops.shape import localize_sizes
from autotp.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    local_shape,
    parse,
    shard_candidates,
)

aten = torch.ops.aten
R, P = Replicate(), Partial()
WORLD_SIZES = (2, 3)
RTOL = ATOL = 1e-5  # fp32 sums of N summands / blocked compute reorder additions
INF = float("inf")

# ATen targets seen in the decomposed graphs of tiny LlamaForCausalLM, MistralForCausalLM,
# Qwen2ForCausalLM (qkv bias) and GPT2LMHeadModel: attn_implementation sdpa and eager, eval and
# train (dropout > 0, labels -> loss), and greedy generate with a DynamicCache (prefill + decode
# graphs). autotp.edge / autotp.mark and SymInt arithmetic (operator.add/sub, sym_max) are the
# solver's business and are not listed.
SEEN_TARGETS = {
    "llama": [
        "aten._log_softmax.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._softmax.default", "aten._to_copy.default", "aten.add.Tensor", "aten.alias.default",
        "aten.any.dim", "aten.arange.start_step", "aten.bernoulli.p", "aten.bernoulli_.float",
        "aten.bmm.default", "aten.cat.default", "aten.clone.default", "aten.constant_pad_nd.default",
        "aten.cos.default", "aten.detach_copy.default", "aten.div.Scalar", "aten.div.Tensor",
        "aten.div_.Scalar", "aten.embedding.default", "aten.empty.memory_format",
        "aten.empty_permuted.default", "aten.eq.Scalar", "aten.expand.default", "aten.full.default",
        "aten.full_like.default", "aten.gather.default", "aten.le.Scalar", "aten.le.Tensor",
        "aten.lift_fresh_copy.default", "aten.logical_and.default", "aten.logical_not.default",
        "aten.mean.dim", "aten.mm.default", "aten.mul.Scalar", "aten.mul.Tensor", "aten.ne.Scalar",
        "aten.neg.default", "aten.permute.default", "aten.pow.Tensor_Scalar", "aten.rsqrt.default",
        "aten.scalar_tensor.default", "aten.sigmoid.default", "aten.sin.default",
        "aten.slice_copy.Tensor", "aten.squeeze.dims", "aten.sub.Tensor", "aten.sum.dim_IntList",
        "aten.unsqueeze.default", "aten.view.default", "aten.view_copy.default", "aten.where.self",
        "operator.getitem",
    ],
    "mistral": [
        "aten._log_softmax.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._softmax.default", "aten._to_copy.default", "aten.add.Tensor", "aten.alias.default",
        "aten.any.dim", "aten.arange.start_step", "aten.bernoulli.p", "aten.bernoulli_.float",
        "aten.bitwise_and.Tensor", "aten.bmm.default", "aten.cat.default", "aten.clone.default",
        "aten.constant_pad_nd.default", "aten.cos.default", "aten.detach_copy.default",
        "aten.div.Scalar", "aten.div.Tensor", "aten.div_.Scalar", "aten.embedding.default",
        "aten.empty.memory_format", "aten.empty_permuted.default", "aten.eq.Scalar",
        "aten.expand.default", "aten.full.default", "aten.full_like.default", "aten.gather.default",
        "aten.gt.Tensor", "aten.le.Scalar", "aten.le.Tensor", "aten.lift_fresh_copy.default",
        "aten.logical_and.default", "aten.logical_not.default", "aten.mean.dim", "aten.mm.default",
        "aten.mul.Scalar", "aten.mul.Tensor", "aten.ne.Scalar", "aten.neg.default",
        "aten.permute.default", "aten.pow.Tensor_Scalar", "aten.rsqrt.default",
        "aten.scalar_tensor.default", "aten.sigmoid.default", "aten.sin.default",
        "aten.slice_copy.Tensor", "aten.squeeze.dims", "aten.sub.Tensor", "aten.sum.dim_IntList",
        "aten.unsqueeze.default", "aten.view.default", "aten.view_copy.default", "aten.where.self",
        "operator.getitem",
    ],
    "qwen2": [
        "aten._log_softmax.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._softmax.default", "aten._to_copy.default", "aten.add.Tensor", "aten.addmm.default",
        "aten.alias.default", "aten.any.dim", "aten.arange.start_step", "aten.bernoulli.p",
        "aten.bernoulli_.float", "aten.bmm.default", "aten.cat.default", "aten.clone.default",
        "aten.constant_pad_nd.default", "aten.cos.default", "aten.detach_copy.default",
        "aten.div.Scalar", "aten.div.Tensor", "aten.div_.Scalar", "aten.embedding.default",
        "aten.empty.memory_format", "aten.empty_permuted.default", "aten.eq.Scalar",
        "aten.expand.default", "aten.full.default", "aten.full_like.default", "aten.gather.default",
        "aten.le.Scalar", "aten.le.Tensor", "aten.lift_fresh_copy.default", "aten.logical_and.default",
        "aten.logical_not.default", "aten.mean.dim", "aten.mm.default", "aten.mul.Scalar",
        "aten.mul.Tensor", "aten.ne.Scalar", "aten.neg.default", "aten.permute.default",
        "aten.pow.Tensor_Scalar", "aten.rsqrt.default", "aten.scalar_tensor.default",
        "aten.sigmoid.default", "aten.sin.default", "aten.slice_copy.Tensor", "aten.squeeze.dims",
        "aten.sub.Tensor", "aten.sum.dim_IntList", "aten.unsqueeze.default", "aten.view.default",
        "aten.view_copy.default", "aten.where.self", "operator.getitem",
    ],
    "gpt2": [
        "aten._log_softmax.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._softmax.default", "aten._to_copy.default", "aten.add.Tensor", "aten.addmm.default",
        "aten.alias.default", "aten.any.dim", "aten.arange.start_step", "aten.bernoulli.p",
        "aten.bernoulli_.float", "aten.bmm.default", "aten.clone.default",
        "aten.constant_pad_nd.default", "aten.detach_copy.default", "aten.div.Scalar",
        "aten.div.Tensor", "aten.div_.Scalar", "aten.embedding.default", "aten.empty.memory_format",
        "aten.empty_like.default", "aten.empty_permuted.default", "aten.eq.Scalar", "aten.expand.default",
        "aten.full.default", "aten.full_like.default", "aten.gather.default", "aten.le.Tensor",
        "aten.lift_fresh_copy.default",
        "aten.logical_and.default", "aten.logical_not.default", "aten.mm.default", "aten.mul.Scalar",
        "aten.mul.Tensor", "aten.native_layer_norm.default", "aten.ne.Scalar", "aten.permute.default",
        "aten.pow.Tensor_Scalar", "aten.scalar_tensor.default", "aten.slice_copy.Tensor",
        "aten.split_copy.Tensor", "aten.squeeze.dims", "aten.sub.Tensor", "aten.sum.dim_IntList",
        "aten.tanh.default", "aten.unsqueeze.default", "aten.view.default", "aten.view_copy.default",
        "aten.where.self", "operator.getitem",
    ],
}

# Overloads whose kernels exist only on CUDA (or a private backend): checked structurally on CPU,
# and through the full simulation when a GPU is present.
CUDA_ONLY = {
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
}


def resolve(name: str) -> Any:
    """``"aten.add.Tensor"`` -> ``torch.ops.aten.add.Tensor``; ``"operator.getitem"`` -> the builtin."""
    if name.startswith("operator."):
        return getattr(operator, name.split(".", 1)[1])
    _, op, overload = name.split(".")
    return getattr(getattr(aten, op), overload)


# ---------------------------------------------------------------------------------------------
# Sample calls
# ---------------------------------------------------------------------------------------------

_gen = torch.Generator().manual_seed(0)


def f(*shape: int) -> torch.Tensor:
    """Standard normal fp32."""
    return torch.randn(shape, generator=_gen)


def pos(*shape: int) -> torch.Tensor:
    """fp32 in (0.1, 0.9): inside every unary op's domain."""
    return torch.rand(shape, generator=_gen) * 0.8 + 0.1


def ints(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_gen)


def bools(*shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=_gen) > 0.5


@dataclass
class Sample:
    target: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)
    exact: bool = True  # pure data movement: bitwise equal unless Partial is involved
    values: bool = True  # False for empty*: only shapes and dtypes are defined
    world_sizes: tuple[int, ...] = WORLD_SIZES
    rtol: float = RTOL
    atol: float = ATOL
    strided: bool = False  # also try equal-segment StridedShard inputs (a merged (batch, heads) dim)

    @property
    def name(self) -> str:
        return str(self.target) if self.target is not operator.getitem else "operator.getitem"


SAMPLES: list[Sample] = []


def sample(target: Any, *args: Any, exact: bool = True, values: bool = True, strided: bool = False,
           **kwargs: Any) -> None:
    SAMPLES.append(Sample(target, args, kwargs, exact=exact, values=values, strided=strided))


def compute(target: Any, *args: Any, **kwargs: Any) -> None:
    """A sample whose local op computes (sums reorder): compare with the fp32 tolerance."""
    sample(target, *args, exact=False, **kwargs)


# --- elementwise ------------------------------------------------------------------------------
UNARY_SPECIAL: dict[str, tuple[tuple, dict]] = {
    "pow.Tensor_Scalar": ((pos(6, 4, 3), 2), {}),
    "pow.Scalar": ((2.0, pos(6, 4, 3)), {}),
    "clamp.default": ((pos(6, 4, 3), 0.3, 0.6), {}),
    "clamp_min.default": ((pos(6, 4, 3), 0.4), {}),
    "clamp_max.default": ((pos(6, 4, 3), 0.4), {}),
    "bitwise_not.default": ((bools(6, 4, 3),), {}),
    "gelu.default": ((f(6, 4, 3),), {"approximate": "tanh"}),
    "leaky_relu.default": ((f(6, 4, 3), 0.1), {}),
    "hardtanh.default": ((f(6, 4, 3),), {}),
}
UNARY_NAMES = list(elementwise.UNARY_NONLINEAR)  # every unary op the rules module registers
for _name in UNARY_NAMES:
    _args, _kw = UNARY_SPECIAL.get(_name, ((pos(6, 4, 3),), {}))
    compute(resolve("aten." + _name), *_args, **_kw)
compute(aten.gelu.default, f(6, 4, 3))

for _name in ["pow.Tensor_Tensor", "maximum.default", "minimum.default", "atan2.default",
              "fmod.Tensor", "remainder.Tensor", "floor_divide.default", "eq.Tensor", "ne.Tensor",
              "lt.Tensor", "le.Tensor", "gt.Tensor", "ge.Tensor", "logical_and.default",
              "logical_or.default", "logical_xor.default"]:
    compute(resolve("aten." + _name), pos(6, 4, 3), pos(4, 1))
    compute(resolve("aten." + _name), pos(6, 1, 3), pos(6, 4, 3))
for _name in ["fmod.Scalar", "remainder.Scalar", "eq.Scalar", "ne.Scalar", "lt.Scalar", "le.Scalar",
              "gt.Scalar", "ge.Scalar"]:
    compute(resolve("aten." + _name), pos(6, 4, 3), 0.5)
for _name in ["bitwise_and", "bitwise_or", "bitwise_xor"]:
    sample(resolve(f"aten.{_name}.Tensor"), bools(6, 4, 3), bools(4, 1))
    sample(resolve(f"aten.{_name}.Scalar"), ints(9, 6, 4), 5)
compute(aten.div.Tensor_mode, pos(6, 4, 3), pos(4, 1), rounding_mode="floor")
compute(aten.div.Scalar_mode, pos(6, 4, 3), 0.3, rounding_mode="trunc")
compute(aten.clamp.Tensor, pos(6, 4, 3), pos(4, 1) * 0.5, pos(6, 1, 3) * 0.5 + 0.5)
sample(aten.where.Scalar, bools(6, 4), 1.0, 0.0)

for _target in [aten.neg.default, aten.clone.default, aten.alias.default, aten.alias_copy.default,
                aten.detach.default, aten.detach_copy.default, aten.lift_fresh_copy.default,
                aten.contiguous.default, aten.positive.default]:
    sample(_target, f(6, 4, 3))
sample(aten.clone.default, ints(5, 6, 4), memory_format=torch.contiguous_format)
sample(aten._to_copy.default, f(6, 4, 3), dtype=torch.float64)
sample(aten._to_copy.default, f(6, 4, 3), dtype=torch.bool)
sample(aten._to_copy.default, ints(7, 6, 4), dtype=torch.float32)
compute(aten.mul.Scalar, f(6, 4, 3), 0.5)
compute(aten.div.Scalar, f(6, 4, 3), 3.0)
compute(aten.mul_.Scalar, f(6, 4, 3), 0.5)
compute(aten.div_.Scalar, f(6, 4, 3), 0.9)

for _target in [aten.add.Tensor, aten.sub.Tensor, aten.rsub.Tensor]:
    compute(_target, f(6, 4, 3), f(4, 3))
    compute(_target, f(6, 1, 3), f(6, 4, 1), alpha=2)
compute(aten.add.Tensor, f(6, 4), 0)
compute(aten.add.Tensor, f(6, 4), 1e-6)
compute(aten.add.Tensor, ints(5, 6, 4), 1)
compute(aten.sub.Tensor, f(6, 4), 2.0)
compute(aten.add.Scalar, f(6, 4), 0.0)
compute(aten.sub.Scalar, f(6, 4), 1.5)
compute(aten.rsub.Scalar, f(6, 4), 0.0)
compute(aten.rsub.Scalar, f(6, 4), 1.0)
compute(aten.add_.Tensor, f(6, 4, 3), f(4, 3))
compute(aten.sub_.Tensor, f(6, 4, 3), f(6, 1, 3))
compute(aten.mul.Tensor, f(6, 4, 3), f(6, 1, 3))
compute(aten.mul.Tensor, f(6, 4), f(4))
compute(aten.mul.Tensor, f(6, 4), 2.0)
compute(aten.mul.Tensor, f(10, 6), torch.tensor(3.0))
compute(aten.mul_.Tensor, f(6, 4, 3), f(4, 1))
compute(aten.div.Tensor, f(6, 4, 3), pos(4, 1))
compute(aten.div.Tensor, f(6, 4), 4.0)
compute(aten.div_.Tensor, f(6, 4, 3), pos(6, 4, 3))
sample(aten.where.self, bools(6, 1, 3), f(6, 4, 3), f(4, 1))
sample(aten.where.self, bools(12, 6), torch.tensor(0.0), torch.tensor(-1e9))
sample(aten.where.ScalarOther, bools(6, 4), f(6, 4), 0.0)
sample(aten.where.ScalarOther, bools(6, 4), f(6, 4), -1e9)
sample(aten.where.ScalarSelf, bools(6, 4), 0.0, f(6, 4))
sample(aten.masked_fill.Scalar, f(6, 4, 3), bools(4, 1), 0.0)
sample(aten.masked_fill.Scalar, f(6, 4, 3), bools(6, 4, 3), -INF)
sample(aten.masked_fill.Tensor, f(6, 4, 3), bools(6, 1, 3), torch.tensor(0.5))
sample(aten.copy.default, f(6, 4), f(4))
sample(aten.copy.default, f(6, 4), f(6, 4))
sample(aten.copy_.default, f(6, 4), f(4))
sample(aten.copy_.default, f(6, 4), f(6, 4))

# --- reductions -----------------------------------------------------------------------------
for _keep in (False, True):
    compute(aten.sum.dim_IntList, f(6, 4, 3), [1], _keep)
    compute(aten.sum.dim_IntList, f(6, 4, 3), [-1, 0], _keep)
    compute(aten.mean.dim, f(6, 4, 3), [-2], _keep)
    compute(aten.mean.dim, f(6, 4, 3), [0, 2], _keep)
    compute(aten.amax.default, f(6, 4, 3), [-1], _keep)
    compute(aten.amin.default, f(6, 4, 3), [0, 1], _keep)
    compute(aten.max.dim, f(6, 4, 3), 1, _keep)
    compute(aten.min.dim, f(6, 4, 3), -1, _keep)
    compute(aten.argmax.default, f(6, 4, 3), 1, _keep)
    compute(aten.any.dim, bools(6, 4, 3), -1, _keep)
    compute(aten.all.dim, bools(6, 4, 3), 0, _keep)
    compute(aten.var_mean.correction, f(6, 4, 3), [2], correction=1, keepdim=_keep)
    compute(aten.logsumexp.default, f(6, 4, 3), [1], _keep)
compute(aten.sum.dim_IntList, f(6, 4, 3), [])
compute(aten.sum.dim_IntList, bools(6, 4), [])
compute(aten.sum.dim_IntList, f(6, 4), None, dtype=torch.float64)
compute(aten.sum.default, f(6, 4))
compute(aten.mean.default, f(6, 4))
compute(aten.argmax.default, f(6, 4))
compute(aten.argmin.default, f(6, 4, 3), 0)
compute(aten.any.dims, bools(6, 4, 3), [0, 2])
compute(aten.all.dims, bools(6, 4, 3), [1], True)
compute(aten.any.default, bools(6, 4))
compute(aten.all.default, bools(6, 4))
compute(aten.max.default, f(6, 4))
compute(aten.min.default, f(6, 4))
compute(aten.var.correction, f(6, 4, 3), [0], correction=0)
compute(aten.std.correction, f(6, 4, 3), [1, 2], keepdim=True)
compute(aten.prod.dim_int, 1 + 0.1 * f(6, 4, 3), 1)
compute(aten.prod.default, 1 + 0.1 * f(6, 4))
compute(aten.linalg_vector_norm.default, f(6, 4, 3), 2, [1])
compute(aten.cumsum.default, f(6, 4, 3), 1)
compute(aten.cumprod.default, pos(6, 4, 3), -1)

# --- softmax and norms ------------------------------------------------------------------------
for _target in [aten._softmax.default, aten._log_softmax.default]:
    compute(_target, f(6, 4, 12), -1, False)
    compute(_target, f(6, 4, 12), 0, False)
compute(aten.softmax.int, f(6, 4, 3), 1)
compute(aten._softmax.default, f(12, 5, 5), -1, False, strided=True)
compute(aten._softmax.default, f(12, 5, 5), 0, False, strided=True)
compute(aten.add.Tensor, f(12, 5, 5), f(12, 1, 5), strided=True)
compute(aten.log_softmax.int, f(6, 4, 3), -1)
compute(aten.native_layer_norm.default, f(6, 4, 6), [6], f(6), f(6), 1e-5)
compute(aten.native_layer_norm.default, f(6, 4, 6), [4, 6], f(4, 6), None, 1e-5)

# --- matmuls ----------------------------------------------------------------------------------
compute(aten.mm.default, f(6, 12), f(12, 10))
compute(aten.bmm.default, f(4, 6, 3), f(4, 3, 10))
compute(aten.addmm.default, f(10), f(6, 12), f(12, 10))
compute(aten.addmm.default, f(6, 10), f(6, 12), f(12, 10), beta=0.5, alpha=2.0)
compute(aten.addmm.default, f(1, 10), f(6, 12), f(12, 10))
compute(aten.baddbmm.default, f(4, 6, 10), f(4, 6, 3), f(4, 3, 10))
compute(aten.baddbmm.default, f(10), f(4, 6, 3), f(4, 3, 10), alpha=0.5)
compute(aten.mv.default, f(6, 12), f(12))
compute(aten.bmm.default, f(12, 5, 4), f(12, 4, 5), strided=True)  # eager attention's (B*H) scores
compute(aten.baddbmm.default, f(12, 1, 5), f(12, 5, 4), f(12, 4, 5), beta=1.0, alpha=0.5,
        strided=True)  # BLOOM: alibi (B*H, 1, S) + q @ k
compute(aten.dot.default, f(12), f(12))
compute(aten.matmul.default, f(2, 6, 12), f(12, 10))
compute(aten.matmul.default, f(4, 1, 6, 3), f(2, 3, 10))
compute(aten.matmul.default, f(12), f(2, 12, 10))
compute(aten.matmul.default, f(6, 12), f(12))
compute(aten.linear.default, f(2, 6, 12), f(10, 12), f(10))
compute(aten.linear.default, f(6, 12), f(10, 12))
# grouped mm (mixture of experts): rows sorted by expert, offs ends each expert's rows. transformers'
# fallback op (a loop of mm) takes awkward sizes; aten._grouped_mm's CPU kernel needs 16-byte strides
_moe_offs = torch.tensor([2, 5, 7], dtype=torch.int32)
compute(torch.ops.transformers.grouped_mm_fallback.default, f(7, 6), f(3, 6, 10), _moe_offs)
SAMPLES.append(Sample(aten._grouped_mm.default, (f(7, 16), f(3, 16, 16)), {"offs": _moe_offs}, exact=False,
                      world_sizes=(2,)))

# --- reshapes and dim shuffles -----------------------------------------------------------------
for _target in [aten.view.default, aten.view_copy.default, aten._unsafe_view.default,
                aten.reshape.default]:
    sample(_target, f(2, 6, 12), [2, 6, 4, 3])  # split H -> (heads, D)
    sample(_target, f(2, 6, 12), [2, 6, -1, 2])
    sample(_target, f(2, 6, 4, 3), [2, 6, 12])  # merge (heads, D) -> H
    sample(_target, f(2, 6, 12), [12, 12])  # merge (B, S)
sample(aten.view.default, f(4, 6), [2, 12])
sample(aten.view.default, f(12), [4, 3])
sample(aten.view.default, f(12), [3, 4])
sample(aten.view.default, f(6, 1, 4), [6, 4])
sample(aten.view.default, f(6, 4), [1, 6, 4, 1])
sample(aten.view.default, f(6, 4), [-1])
sample(aten.view.default, ints(9, 6, 4), [2, 3, 4])
sample(aten.view.default, f(2, 3, 2, 6), [2, 6, 6])  # (kv, rep) merge with kv sharded
# eager attention at batch > 1: (B, heads) merged into one dim and split back; heads sharded is a
# strided shard of the merged dim (B segments of heads), tried with strided inputs too
for _target in [aten.view.default, aten._unsafe_view.default, aten.reshape.default]:
    sample(_target, f(2, 6, 5, 4), [12, 5, 4], strided=True)  # (B, H, S, D) -> (B*H, S, D)
    sample(_target, f(12, 5, 5), [2, 6, 5, 5], strided=True)  # (B*H, S, S) -> (B, H, S, S)
sample(aten.view.default, f(3, 6, 4), [18, 4], strided=True)  # three segments
sample(aten.view.default, f(3, 6, 4), [-1], strided=True)  # merged with the dims behind it too
sample(aten.view.default, f(2, 6, 5, 4), [4, 3, 20], strided=True)  # the merged dim cuts the sharded one
sample(aten.view.default, f(18, 4), [3, 6, 4], strided=True)
sample(aten.view.default, f(2, 4, 3), [3, 8], strided=True)  # no whole-row chunk: rejected
sample(aten.view.default, f(12, 5, 4), [12, 20], strided=True)  # a strided dim kept whole
for _target in [aten.expand.default, aten.expand_copy.default]:
    sample(_target, f(6, 1, 3), [2, 6, 4, 3])
    sample(_target, f(6, 1, 3), [-1, 12, -1])
sample(aten.expand.default, ints(5, 1, 6), [6, 6])
for _target in [aten.permute.default, aten.permute_copy.default]:
    sample(_target, f(6, 4, 3), [2, 0, 1])
    sample(_target, f(6, 4, 3), [-1, 0, 1])
for _target in [aten.transpose.int, aten.transpose_copy.int]:
    sample(_target, f(6, 4, 3), 0, -1)
    sample(_target, f(6, 4, 3), 1, 2)
for _target in [aten.t.default, aten.t_copy.default]:
    sample(_target, f(6, 4))
sample(aten.t.default, f(6))
for _target in [aten.unsqueeze.default, aten.unsqueeze_copy.default]:
    sample(_target, f(6, 4), 1)
    sample(_target, f(6, 4), -1)
    sample(_target, f(6, 4), 0)
for _target in [aten.squeeze.dims, aten.squeeze_copy.dims]:
    sample(_target, f(6, 1, 4, 1), [1, -1])
    sample(_target, f(1, 6, 1, 4), [0, 1, 3])
for _target in [aten.squeeze.dim, aten.squeeze_copy.dim]:
    sample(_target, f(6, 1, 4), 1)
    sample(_target, f(1, 6, 4), -3)
for _target in [aten.squeeze.default, aten.squeeze_copy.default]:
    sample(_target, f(1, 6, 1, 4))

# --- indexing, joining, splitting ---------------------------------------------------------------
for _target in [aten.select.int, aten.select_copy.int]:
    sample(_target, f(6, 4, 3), 1, 2)
    sample(_target, f(6, 4, 3), -1, 0)
for _target in [aten.slice.Tensor, aten.slice_copy.Tensor]:
    sample(_target, f(6, 4, 3), 1, 1, 3)
    sample(_target, f(6, 4, 3), 0, 0, 9223372036854775807)
    sample(_target, f(6, 4, 3), -1, None, None)
    sample(_target, f(6, 4, 3), 0, 0, 6, 2)
    sample(_target, f(6, 4, 3), 2, -2)
for _target in [aten.narrow.default, aten.narrow_copy.default]:
    sample(_target, f(6, 4, 3), 1, 0, 2)
    sample(_target, f(6, 4, 3), 0, 0, 6)
sample(aten.index_select.default, f(6, 4, 3), 1, ints(4, 6))
sample(aten.index_select.default, f(6, 4, 3), -3, ints(6, 12))
sample(aten.gather.default, f(6, 4, 3), 1, ints(4, 6, 4, 3))
sample(aten.gather.default, f(6, 4, 3), 2, ints(3, 6, 4, 2))
sample(aten.gather.default, f(6, 4, 3), 1, ints(4, 3, 4, 3))
sample(aten.gather.default, f(12, 10), -1, ints(10, 12, 1))
sample(aten.index.Tensor, f(6, 4, 3), [None, ints(4, 5)])
sample(aten.index.Tensor, f(6, 4, 3), [ints(6, 2, 5), None, ints(3, 2, 5)])
sample(aten.index.Tensor, f(6, 4, 3), [ints(6, 4)])
sample(aten.index.Tensor, f(6, 4, 3), [bools(6)])
sample(aten.cat.default, [f(6, 4), f(6, 2)], 1)
sample(aten.cat.default, [f(6, 4), f(6, 6)], -1)
sample(aten.cat.default, [f(6, 4), f(4, 4)], 0)
sample(aten.cat.default, [torch.tensor([]), f(2, 6, 5, 4)], -2)  # DynamicCache prefill
sample(aten.cat.default, [f(2, 6, 3, 4), f(2, 6, 1, 4)], -2)  # decode step
sample(aten.stack.default, [f(6, 4), f(6, 4), f(6, 4)], 1)
sample(aten.stack.default, [f(6, 4), f(6, 4)], -1)
for _target in [aten.split.Tensor, aten.split_copy.Tensor]:
    sample(_target, f(6, 4, 3), 2, 1)
    sample(_target, f(6, 4, 3), 4, 1)
    sample(_target, f(6, 12), 4, -1)
for _target in [aten.split_with_sizes.default, aten.split_with_sizes_copy.default]:
    sample(_target, f(6, 4, 3), [1, 3], 1)
    sample(_target, f(6, 4, 3), [2, 4])
for _target in [aten.unbind.int, aten.unbind_copy.int]:
    sample(_target, f(6, 4, 3), 1)
    sample(_target, f(2, 6, 4))
sample(aten.constant_pad_nd.default, ints(10, 6, 4), [0, 1], -100.0)
sample(aten.constant_pad_nd.default, f(6, 4, 3), [1, 1], 0.0)
sample(aten.constant_pad_nd.default, f(6, 4, 3), [0, 0, 2, 0], 0.5)
sample(aten.repeat.default, f(6, 4), [2, 1, 1])
sample(aten.repeat.default, f(6, 4), [1, 3])
sample(aten.repeat.default, f(6, 1, 4), [2, 1, 1], strided=True)  # BLOOM's alibi: (H, 1, S) -> (B*H, 1, S)
sample(aten.repeat.default, f(2, 6, 4), [1, 3, 1], strided=True)
sample(aten.tril.default, f(2, 4, 4))
sample(aten.triu.default, f(6, 4, 4), 1)
sample(aten.flip.default, f(6, 4, 3), [0])
sample(aten.flip.default, f(6, 4, 3), [-1, 1])
sample(aten.slice_scatter.default, f(6, 4, 3), f(6, 2, 3), 1, 1, 3)
sample(aten.slice_scatter.default, f(6, 4), f(6, 4), 0)
sample(aten.select_scatter.default, f(6, 4, 3), f(6, 3), 1, 2)

# --- embedding ----------------------------------------------------------------------------------
sample(aten.embedding.default, f(12, 6), ints(12, 2, 6))
sample(aten.embedding.default, f(12, 6), ints(12, 6), 3)

# --- attention ----------------------------------------------------------------------------------
_q, _k, _v = f(2, 6, 5, 4), f(2, 6, 5, 4), f(2, 6, 5, 4)
compute(aten.scaled_dot_product_attention.default, _q, _k, _v, is_causal=True)
compute(aten.scaled_dot_product_attention.default, f(2, 8, 5, 4), f(2, 4, 5, 4), f(2, 4, 5, 4),
        f(2, 1, 5, 5), enable_gqa=True)  # GQA, additive mask broadcast over heads
compute(aten.scaled_dot_product_attention.default, _q, f(2, 6, 3, 4), f(2, 6, 3, 4), f(2, 6, 5, 3),
        scale=0.3)  # mask with a full head dim; decode-like L != S
compute(aten._scaled_dot_product_flash_attention_for_cpu.default, _q, _k, _v, 0.0, True, scale=0.3)
compute(aten._scaled_dot_product_flash_attention_for_cpu.default, f(2, 6, 5, 4), f(2, 3, 7, 4),
        f(2, 3, 7, 4), 0.0, False, attn_mask=f(5, 7))  # GQA 6/3 heads; 2-D mask
compute(aten._scaled_dot_product_attention_math.default, _q, _k, _v, f(1, 6, 5, 5))
compute(aten.scaled_dot_product_attention.default, f(2, 6, 5, 4), f(2, 1, 5, 4), f(2, 1, 5, 4),
        is_causal=True, enable_gqa=True)  # multi-query: one kv head, Replicate on every rank

# --- creation and random ------------------------------------------------------------------------
sample(aten.arange.start_step, 0, 6, 2)
sample(aten.arange.default, 6)
sample(aten.arange.start, 1, 7)
sample(aten.full.default, [6, 4], 2.0)
sample(aten.zeros.default, [6, 4])
sample(aten.ones.default, [6, 4], dtype=torch.int64)
sample(aten.empty.memory_format, [6, 4], values=False)
sample(aten.empty_strided.default, [6, 4], [4, 1], values=False)
sample(aten.empty_permuted.default, [2, 6, 4], [0, 2, 1], values=False)
sample(aten.scalar_tensor.default, -INF, dtype=torch.float32)
sample(aten.scalar_tensor.default, 0.0, dtype=torch.float32)  # zeros: also a valid Partial
sample(aten.full.default, [6, 4], 0.0)
sample(aten.rand.default, [6, 4])
sample(aten.randn.default, [6, 4])
sample(aten.randint.default, 10, [6])
sample(aten.randint.low, 2, 10, [6])
sample(aten.randperm.default, 6)
sample(aten.eye.default, 4)
sample(aten.linspace.default, 0.0, 1.0, 6)
sample(aten.new_zeros.default, f(6, 4), [3, 2])
sample(aten.new_ones.default, f(6, 4), [3, 2])
sample(aten.new_full.default, f(6, 4), [3, 2], 1.5)
sample(aten.new_empty.default, f(6, 4), [3, 2], values=False)
sample(aten.new_empty_strided.default, f(6, 4), [3, 2], [2, 1], values=False)
sample(aten.full_like.default, f(6, 4, 3), 0.5)
sample(aten.full_like.default, ints(5, 6, 4), 0)
sample(aten.zeros_like.default, f(6, 4, 3))
sample(aten.ones_like.default, f(6, 4, 3))
sample(aten.empty_like.default, f(6, 4, 3), values=False)
sample(aten.fill.Scalar, f(6, 4, 3), 3.0)
sample(aten.rand_like.default, f(6, 4))
sample(aten.randn_like.default, f(6, 4))
sample(aten.randint_like.default, f(6, 4), 10)
sample(aten.randint_like.low_dtype, f(6, 4), 2, 10)
sample(aten.bernoulli.p, f(6, 4), 0.3)
sample(aten.bernoulli_.float, f(6, 4), 0.3)
sample(aten.bernoulli.default, pos(6, 4))
sample(aten.native_dropout.default, f(6, 4), 0.5, True)
sample(aten.native_dropout.default, f(6, 4), 0.5, False)

# --- getitem of a multi-output op (flattened tuple placement) ------------------------------------
sample(operator.getitem, (f(6, 4), ints(3, 6)), 1)
sample(operator.getitem, (f(6, 4), f(6, 1)), -2)


def _cuda_samples() -> list[Sample]:
    """CUDA-only attention kernels (fp16, so a looser 2e-3 tolerance), simulated on a GPU."""
    if not torch.cuda.is_available():
        return []

    def g(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=_gen).to("cuda", torch.float16)

    q = (g(2, 6, 8, 64), g(2, 6, 8, 64), g(2, 6, 8, 64))
    return [
        Sample(aten._scaled_dot_product_efficient_attention.default, q + (g(2, 1, 8, 8), True, 0.0, False),
               exact=False, rtol=2e-3, atol=2e-3),
        Sample(aten._scaled_dot_product_flash_attention.default, q + (0.0, True), exact=False,
               rtol=2e-3, atol=2e-3),
        Sample(aten._scaled_dot_product_cudnn_attention.default, q + (None, True, 0.0, True), exact=False,
               rtol=2e-3, atol=2e-3),
    ]


CUDA_SAMPLES = _cuda_samples()


# ---------------------------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------------------------

def _spec(value: Any) -> Any:
    """A tensor's spec; a small integer tensor keeps its values, as decompose records constants."""
    if not isinstance(value, torch.Tensor):
        return value
    constant = value.dtype in (torch.int32, torch.int64) and value.numel() <= 64
    return TensorSpec(tuple(value.shape), value.dtype, value=tuple(value.flatten().tolist()) if constant else None)


def _out_spec(result: Any) -> Any:
    if isinstance(result, (tuple, list)):
        return tuple(_spec(r) if isinstance(r, torch.Tensor) else None for r in result)
    return _spec(result)


def options(t: torch.Tensor, world_size: int, strided: bool = False) -> list[Placement]:
    """The placements the solver may ask about for this tensor (with ``strided``, also every
    split of a dim into 2 or more equal segments that divide by N: a merged (batch, heads) dim)."""
    opts: list[Placement] = [R]
    if t.is_floating_point():
        opts.append(P)
    opts += shard_candidates(tuple(t.shape), world_size)
    if strided:
        opts += [StridedShard(d, (size // k,) * k) for d, size in enumerate(t.shape)
                 for k in range(2, size + 1) if size % k == 0 and size // k % world_size == 0]
    return opts


def distribute(t: torch.Tensor, p: Placement, world_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    """The N local tensors of ``t`` under ``p``."""
    if isinstance(p, StridedShard):
        return [piece.contiguous() for piece in strided_pieces(t, p, world_size)]
    if isinstance(p, Shard):
        return [c.contiguous() for c in torch.chunk(t, world_size, p.dim)]
    if isinstance(p, Partial):
        parts = [torch.randn(t.shape, generator=gen).to(t.device, t.dtype) for _ in range(world_size - 1)]
        return parts + [t - sum(parts)]
    return [t.clone() for _ in range(world_size)]


def _run(target: Any, args: tuple, kwargs: dict) -> Any:
    args, kwargs = pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, (args, kwargs))
    torch.manual_seed(1234)  # replicated random ops: every rank draws the same numbers
    if target is operator.getitem:
        return target(*args)
    return target(*args, **kwargs)


def _check(name: str, outs: list[Any], p: Any, full: Any, world_size: int, exact: bool,
           values: bool, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Reassemble per-rank ``outs`` by placement ``p`` and compare with ``full``."""
    if isinstance(full, (tuple, list)):
        assert isinstance(p, tuple) and len(p) == len(full), f"{name}: placement {p} for {len(full)} results"
        for j, pj in enumerate(p):
            if pj is not None and isinstance(full[j], torch.Tensor):
                _check(f"{name}[{j}]", [o[j] for o in outs], pj, full[j], world_size, exact, values, rtol, atol)
        return
    assert isinstance(p, (Replicate, Shard, Partial)), f"{name}: {p!r} is not a placement"
    expect_local = local_shape(tuple(full.shape), p, world_size)
    for r, o in enumerate(outs):
        assert tuple(o.shape) == expect_local, f"{name}: rank {r} holds {tuple(o.shape)}, {p} needs {expect_local}"
        assert o.dtype == full.dtype, f"{name}: dtype {o.dtype} != {full.dtype}"
    if isinstance(p, StridedShard):
        got = unstride(outs, p, world_size)
    elif isinstance(p, Shard):
        got = torch.cat(outs, p.dim)
    elif isinstance(p, Partial):
        assert full.is_floating_point(), f"{name}: a {full.dtype} result cannot be Partial"
        got = sum(outs[1:], outs[0])
        exact = False
    else:
        if values:
            for r, o in enumerate(outs[1:], start=1):
                torch.testing.assert_close(o, outs[0], rtol=0, atol=0, equal_nan=True,
                                           msg=lambda m, r=r: f"{name}: Replicate differs on rank {r}: {m}")
        got = outs[0]
    if not values:
        return
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": rtol, "atol": atol}
    torch.testing.assert_close(got, full, equal_nan=True, **tol,
                               msg=lambda m: f"{name}: reassembled {p} differs: {m}")


def check_sample(s: Sample) -> int:
    """Simulate every candidate for every input placement combination; returns how many ran."""
    rule = registry.lookup(s.target)
    assert rule is not None, f"no rule for {s.name}"
    full = _run(s.target, s.args, s.kwargs)
    leaves, tree = pytree.tree_flatten((s.args, s.kwargs))
    tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    spec_args, spec_kwargs = pytree.tree_map_only(torch.Tensor, _spec, (s.args, s.kwargs))
    gen = torch.Generator().manual_seed(7)
    simulated = 0
    for world_size in s.world_sizes:
        op = OpCall(s.target, spec_args, spec_kwargs, _out_spec(full), world_size)
        choices = [options(leaves[i], world_size, s.strided) for i in tensor_pos]
        for combo in itertools.product(*choices):
            cands = rule(op, list(combo))
            assert isinstance(cands, list), f"{s.name}: rule returned {type(cands)}"
            if all(isinstance(p, Replicate) for p in combo):
                assert cands, f"{s.name}: all-Replicate inputs rejected: {getattr(cands, 'reason', '')}"
            if not cands:
                assert isinstance(cands, Rejected) and cands.reason, f"{s.name}: empty list without reason"
                continue
            locals_ = [distribute(leaves[i], p, world_size, gen) for i, p in zip(tensor_pos, combo, strict=True)]
            for cand in cands:
                assert isinstance(cand, Candidate)
                rank_inputs = []
                for rank in range(world_size):
                    rank_leaves = list(leaves)
                    for i, pieces in zip(tensor_pos, locals_, strict=True):
                        rank_leaves[i] = pieces[rank]
                    rank_inputs.append(pytree.tree_unflatten(rank_leaves, tree))
                if cand.local is not None and registry.local_impl_is_across_ranks(cand.local):
                    # a rewrite that communicates: all ranks at once (the all-reduces it prices)
                    assert cand.collectives, f"{s.name}: {cand.local} communicates but lists no collectives"
                    impl = registry.local_impl(cand.local)
                    outs = impl(s.target, [a for a, _ in rank_inputs], [k for _, k in rank_inputs], list(combo),
                                cand.output, world_size)
                else:
                    outs = []
                    for rank, (args, kwargs) in enumerate(rank_inputs):
                        if cand.local is None:
                            outs.append(_run(s.target, args, kwargs))
                        else:
                            impl = registry.local_impl(cand.local)
                            torch.manual_seed(1234)
                            outs.append(impl(s.target, args, kwargs, list(combo), cand.output, rank, world_size))
                exact = s.exact and not any(isinstance(p, Partial) for p in combo)
                # a shard's own random stream draws other numbers than one process: shapes only
                values = s.values and cand.local != RANK_RNG
                _check(f"{s.name} N={world_size} in={list(combo)} out={cand.output} local={cand.local}",
                       outs, cand.output, full, world_size, exact, values, s.rtol, s.atol)
                simulated += 1
    return simulated


def _ids(s: Sample) -> str:
    return s.name.replace("aten.", "")


@pytest.mark.parametrize("s", SAMPLES, ids=[_ids(s) for s in SAMPLES])
def test_every_candidate_reassembles_to_the_unsharded_result(s: Sample) -> None:
    check_sample(s)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("s", CUDA_SAMPLES, ids=[_ids(s) for s in CUDA_SAMPLES])
def test_cuda_attention_candidates_reassemble_on_a_gpu(s: Sample) -> None:
    try:
        _run(s.target, s.args, s.kwargs)
    except RuntimeError as e:  # this GPU / build lacks the kernel for these sizes
        pytest.skip(f"{s.name} does not run here: {e}")
    check_sample(s)


# ---------------------------------------------------------------------------------------------
# Coverage
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", sorted(SEEN_TARGETS))
def test_every_target_seen_in_the_tiny_model_graphs_has_a_rule(model: str) -> None:
    missing = [name for name in SEEN_TARGETS[model] if registry.lookup(resolve(name)) is None]
    assert not missing, f"{model}: no rule for {missing}"


def test_every_registered_rule_has_a_ground_truth_sample() -> None:
    sampled = {s.target for s in SAMPLES} | {str(s.target) for s in SAMPLES}  # other libraries' ops by name
    cuda_only = {resolve(n) for n in CUDA_ONLY}
    untested = [str(t) for t in registry.registered_targets() if t not in sampled and t not in cuda_only]
    assert not untested, f"rules without a sample: {untested}"


def test_local_rewrites_named_by_rules_are_registered() -> None:
    for name in ("shape", "vocab_parallel", "replicated_share", "sharded_softmax", "vocab_gather"):
        assert callable(registry.local_impl(name))


# ---------------------------------------------------------------------------------------------
# Known answers: the layouts tensor parallelism lives on, and infeasible combinations
# ---------------------------------------------------------------------------------------------

def ask(target: Any, args: tuple, placements: list[Any], world_size: int = 2, **kwargs: Any) -> list[Candidate]:
    """Call the rule on specs of ``args`` (tensors are replaced by their specs)."""
    full = _run(target, args, kwargs)
    spec_args, spec_kwargs = pytree.tree_map_only(torch.Tensor, _spec, (args, kwargs))
    op = OpCall(target, spec_args, spec_kwargs, _out_spec(full), world_size)
    return registry.lookup(target)(op, placements)


def outputs(cands: list[Candidate]) -> list[Any]:
    return [(c.output, c.local) for c in cands]


def test_the_rules_find_the_tensor_parallel_layouts() -> None:
    x, w = f(6, 12), f(12, 10)
    assert outputs(ask(aten.mm.default, (x, w), [R, Shard(1)])) == [(Shard(1), None)]  # column-parallel
    assert outputs(ask(aten.mm.default, (x, w), [Shard(1), Shard(0)])) == [(P, None)]  # row-parallel
    assert outputs(ask(aten.addmm.default, (f(10), x, w), [Shard(0), R, Shard(1)])) == [(Shard(1), None)]
    assert outputs(ask(aten.addmm.default, (f(10), x, w), [P, Shard(1), Shard(0)])) == [(P, None)]
    assert outputs(ask(aten.view.default, (f(2, 6, 12), [2, 6, -1, 3]), [Shard(2)])) == [(Shard(2), "shape")]
    assert outputs(ask(aten.view.default, (f(2, 6, 4, 3), [2, 6, 12]), [Shard(2)])) == [(Shard(2), "shape")]
    # repeat_kv: (B, kv, 1, S, D) -> expand (B, kv, rep, S, D) -> reshape (B, kv*rep, S, D)
    assert outputs(ask(aten.expand.default, (f(2, 4, 1, 5, 3), [2, 4, 2, 5, 3]), [Shard(1)])) \
        == [(Shard(1), "shape")]
    assert outputs(ask(aten.view.default, (f(2, 4, 2, 5, 3), [2, 8, 5, 3]), [Shard(1)])) == [(Shard(1), "shape")]
    assert outputs(ask(aten.embedding.default, (f(12, 6), ints(12, 2, 5)), [Shard(0), R])) \
        == [(P, "vocab_parallel")]
    # a column split looks up each rank's columns: the output is split on its last dim (which tables
    # may take it is the backend's choice: autotp/ops/embedding.py)
    assert outputs(ask(aten.embedding.default, (f(12, 6), ints(12, 2, 5)), [Shard(1), R])) == [(Shard(2), None)]
    q, kv = f(2, 8, 5, 4), f(2, 4, 5, 4)
    heads = ask(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, kv, kv, 0.0, True),
                [Shard(1)] * 3)
    assert outputs(heads) == [((Shard(1), Shard(1)), None)]
    assert outputs(ask(aten.sum.dim_IntList, (f(6, 4, 3), [1]), [Shard(1)])) == [(P, None)]
    assert outputs(ask(aten.sum.dim_IntList, (f(6, 4, 3), [0]), [Shard(2)], world_size=3)) == [(Shard(1), None)]
    assert outputs(ask(aten.mean.dim, (f(6, 4, 3), [-1], True), [Shard(0)])) == [(Shard(0), None)]
    # a mean over its sharded dim: each rank's chunk mean scaled by its share, summed by the ranks
    assert outputs(ask(aten.mean.dim, (f(6, 4, 3), [-1], True), [Shard(2)])) == [(P, "sharded_mean")]
    assert outputs(ask(aten.mul.Tensor, (f(6, 4), f(4)), [P, R])) == [(P, None)]
    assert outputs(ask(aten._to_copy.default, (f(6, 4),), [P], dtype=torch.bfloat16)) == [(P, None)]


def test_vocab_parallel_cross_entropy_keeps_the_logits_sharded() -> None:
    # log_softmax over the sharded vocab dim: two all-reduces of one fp32 value per row (6 rows)
    (softmax,) = ask(aten._log_softmax.default, (f(6, 8), 1, False), [Shard(1)])
    assert (softmax.output, softmax.local) == (Shard(1), "sharded_softmax")
    assert softmax.collectives == (("all_reduce", 6 * 4), ("all_reduce", 6 * 4))
    # picking each row's target log-probability: the rank holding it reads it, the others give 0
    assert outputs(ask(aten.gather.default, (f(6, 8), 1, ints(8, 6, 1)), [Shard(1), R])) == [(P, "vocab_gather")]
    # the zero branch of where(valid, picked, 0) may be Partial, so the masked pick stays Partial
    assert outputs(ask(aten.scalar_tensor.default, (0.0,), [], dtype=torch.float32)) == [(R, None), (P, None)]
    assert outputs(ask(aten.scalar_tensor.default, (1.0,), [], dtype=torch.float32)) == [(R, None)]


@pytest.mark.parametrize(("target", "args", "placements", "kwargs"), [
    (aten._softmax.default, (f(6, 4), 0, False), [P], {}),
    (aten.gather.default, (f(6, 4), 1, ints(4, 6, 1)), [Shard(1), Shard(0)], {}),
    (aten.add.Tensor, (f(6, 4), 1e-6), [P], {}),
    (aten.add.Tensor, (f(6, 4), f(4)), [Shard(1), R], {}),
    (aten.mul.Tensor, (f(6, 4), f(6, 4)), [P, P], {}),
    (aten.mul.Tensor, (f(6, 4), f(6, 1)), [P, Shard(0)], {}),
    (aten.div.Tensor, (f(6, 4), pos(6, 4)), [R, P], {}),
    (aten.exp.default, (f(6, 4),), [P], {}),
    (aten.silu.default, (f(6, 4),), [P], {}),
    (aten.pow.Tensor_Scalar, (f(6, 4), 2), [P], {}),
    (aten.var_mean.correction, (f(6, 4), [1]), [Shard(1)], {"correction": 1}),
    (aten.amax.default, (f(6, 4), [0]), [Shard(0)], {}),
    (aten.sum.dim_IntList, (bools(6, 4), [1]), [Shard(1)], {}),
    (aten._to_copy.default, (f(6, 4),), [P], {"dtype": torch.int64}),
    (aten.mm.default, (f(6, 12), f(12, 10)), [R, Shard(0)], {}),
    (aten.mm.default, (f(6, 12), f(12, 10)), [Shard(0), Shard(1)], {}),
    (aten.addmm.default, (f(10), f(6, 12), f(12, 10)), [R, R, Shard(1)], {}),
    (aten.view.default, (f(2, 6, 12), [2, 6, 3, 4]), [Shard(2)], {}),
    (aten.view.default, (f(2, 4, 3), [3, 8]), [Shard(1)], {}),  # a rank's heads are not whole rows
    (aten.view.default, (f(12, 5, 5), [2, 6, 25]), [StridedShard(0, (4, 4, 4))], {}),  # not per segment
    (aten.cat.default, ([f(6, 4), f(6, 4)], 1), [Shard(1), Shard(1)], {}),
    (aten.cat.default, ([f(6, 4), f(6, 4)], 0), [Shard(1), R], {}),
    (aten.slice.Tensor, (f(6, 4), 0, 0, 2), [Shard(0)], {}),
    (aten.split_copy.Tensor, (f(6, 12), 4, -1), [Shard(1)], {}),
    (aten.embedding.default, (f(12, 6), ints(12, 6)), [Shard(0), Shard(0)], {}),
    (aten.embedding.default, (f(12, 5), ints(12, 6)), [Shard(1), R], {}),  # columns no rank count divides
    (aten.embedding.default, (f(12, 6), ints(12, 6)), [StridedShard(0, (6, 6)), R], {}),  # plain splits only
    (aten._scaled_dot_product_flash_attention_for_cpu.default, (f(2, 6, 4, 4),) * 3 + (0.0, True),
     [Shard(2)] * 3, {}),
    (aten.scaled_dot_product_attention.default, (f(2, 6, 4, 4),) * 3 + (f(2, 6, 4, 4),),
     [Shard(1)] * 3 + [R], {}),
    (aten.bernoulli.default, (pos(6, 4),), [Partial()], {}),  # probabilities cannot be partial sums
    (aten.native_layer_norm.default, (f(6, 4), [4], f(4), f(4), 1e-5), [Shard(1), R, R], {}),
])
def test_infeasible_combinations_are_rejected_with_a_reason(target: Any, args: tuple, placements: list,
                                                            kwargs: dict) -> None:
    cands = ask(target, args, placements, **kwargs)
    assert cands == [] and isinstance(cands, Rejected) and cands.reason, f"expected a rejection, got {cands}"


def test_getitem_takes_the_element_of_a_tuple_placement() -> None:
    op = OpCall(operator.getitem, ((TensorSpec((6, 4), torch.float32), None), 0), {},
                TensorSpec((6, 4), torch.float32), 2)
    rule = registry.lookup(operator.getitem)
    assert outputs(rule(op, [(Shard(1), None)])) == [(Shard(1), None)]
    op1 = OpCall(operator.getitem, ((TensorSpec((6, 4), torch.float32), None), 1), {}, None, 2)
    assert rule(op1, [(Shard(1), None)]) == []


def test_attention_with_dropout_keeps_the_same_candidates() -> None:
    q = f(2, 6, 5, 4)
    for placement in ([Shard(1)] * 3, [Shard(0)] * 3, [R] * 3):
        plain = ask(aten.scaled_dot_product_attention.default, (q, q, q, None, 0.0, True), placement)
        drop = ask(aten.scaled_dot_product_attention.default, (q, q, q, None, 0.3, True), placement)
        assert outputs(plain) == outputs(drop) and plain


def test_cuda_only_attention_overloads_shard_heads() -> None:
    """Rules for kernels we cannot run on CPU, checked on their schemas' result layouts."""
    f16 = torch.float16
    q = TensorSpec((2, 6, 5, 8), f16)
    lse = TensorSpec((2, 6, 5), torch.float32)
    scalar = TensorSpec((), torch.int64)
    nine = (q, lse, None, None, None, None, scalar, scalar, TensorSpec((0,), f16))
    cases = {
        "_scaled_dot_product_efficient_attention": ((q, q, q, TensorSpec((2, 1, 5, 5), f16), True),
                                                    (q, lse, scalar, scalar)),
        "_scaled_dot_product_flash_attention": ((q, q, q, 0.0, True), nine),
        "_scaled_dot_product_cudnn_attention": ((q, q, q, None, True), nine),
        "_scaled_dot_product_fused_attention_overrideable": ((q, q, q), nine),
    }
    for name, (args, out) in cases.items():
        target = getattr(aten, name).default
        rule = registry.lookup(target)
        mask = [R] if sum(isinstance(a, TensorSpec) for a in args) == 4 else []  # broadcast over heads
        got = rule(OpCall(target, args, {}, out, 2), [Shard(1)] * 3 + mask)
        assert len(got) == 1 and len(got[0].output) == len(out), name
        assert got[0].output[:2] == (Shard(1), Shard(1)) and set(got[0].output[2:]) == {None}, name
        assert rule(OpCall(target, args, {}, out, 2), [Shard(2)] * 3 + mask) == [], name


def test_localize_sizes_divides_only_the_shard_dim() -> None:
    assert localize_sizes([2, 6, 8, 8], Shard(2), 2) == [2, 6, 4, 8]
    assert localize_sizes([2, 6, -1, 8], Shard(2), 4) == [2, 6, -1, 8]
    assert localize_sizes([2, -1, 12], Shard(2), 3) == [2, -1, 4]
    assert localize_sizes([2, 6, 12], Replicate(), 3) == [2, 6, 12]


def test_localize_sizes_gives_each_rank_its_chunk_of_an_uneven_dim() -> None:
    """torch.chunk's chunks: 10 over 3 ranks is 4 + 4 + 2 (a vocabulary no tp divides)."""
    assert [localize_sizes([2, 6, 10], Shard(2), 3, rank)[2] for rank in range(3)] == [4, 4, 2]
    assert [len(c) for c in torch.arange(10).chunk(3)] == [4, 4, 2]


def test_vocab_parallel_embedding_adds_up_and_remaps_the_padding_row() -> None:
    weight, ids = f(12, 6), torch.tensor([[0, 3, 11, 5], [6, 7, 3, 9]])
    total = sum(vocab_parallel_embedding(ids, chunk, r * 4, padding_idx=5)
                for r, chunk in enumerate(torch.chunk(weight, 3, 0)))
    torch.testing.assert_close(total, torch.nn.functional.embedding(ids, weight), rtol=0, atol=0)
    # padding_idx only changes the gradient: the padding row gets none, on the rank that owns it
    w = weight.clone().requires_grad_(True)
    pieces = torch.chunk(w, 3, 0)
    sum(vocab_parallel_embedding(ids, p, r * 4, padding_idx=5).sum() for r, p in enumerate(pieces)).backward()
    ref = weight.clone().requires_grad_(True)
    torch.nn.functional.embedding(ids, ref, padding_idx=5).sum().backward()
    torch.testing.assert_close(w.grad, ref.grad, rtol=0, atol=0)
    assert math.isclose(float(w.grad[5].abs().sum()), 0.0)


def test_a_replicated_summand_of_a_partial_is_shared_out_one_nth_per_rank() -> None:
    # row-parallel layer with a bias, residual added to a row-parallel result: P + R stays P
    share = "replicated_share"
    assert outputs(ask(aten.add.Tensor, (f(6, 4), f(6, 4)), [P, R])) == [(P, share)]
    assert outputs(ask(aten.sub.Tensor, (f(6, 4), f(4)), [R, P])) == [(P, share)]
    assert outputs(ask(aten.addmm.default, (f(10), f(6, 12), f(12, 10)), [R, Shard(1), Shard(0)])) == [(P, share)]
    assert outputs(ask(aten.linear.default, (f(2, 6, 12), f(10, 12), f(10)), [Shard(2), Shard(1), R])) == [(P, share)]
    # a Replicate factor of the product is not a summand: addmm(R, P, R) shares only the bias
    assert outputs(ask(aten.addmm.default, (f(10), f(6, 12), f(12, 10)), [R, P, R])) == [(P, share)]
    # exactness: over 2 and 4 ranks R / N is exact, so the only error is the reordered sum (fp32)
    bias, a, w = f(10), f(6, 12), f(12, 10)
    for n in (2, 4):
        impl = registry.local_impl(share)
        outs = [impl(aten.addmm.default, (bias, xa, xw), {}, [R, Shard(1), Shard(0)], P, r, n)
                for r, (xa, xw) in enumerate(zip(a.chunk(n, 1), w.chunk(n, 0), strict=True))]
        torch.testing.assert_close(sum(outs), torch.addmm(bias, a, w), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# Fused projections: StridedShard (rank r holds chunk r of each segment)
# ---------------------------------------------------------------------------------------------

def strided_pieces(t: torch.Tensor, p: Any, world_size: int) -> list[torch.Tensor]:
    """The N local tensors of ``t`` under a StridedShard ``p``."""
    return [torch.cat([t.narrow(p.dim, a, b - a) for a, b in p.pieces(r, world_size)], p.dim)
            for r in range(world_size)]


def unstride(local: list[torch.Tensor], p: Any, world_size: int) -> torch.Tensor:
    """Inverse of :func:`strided_pieces`: the whole tensor from the N local ones."""
    steps = [size // world_size for size in p.segments]
    pieces = [o.split(steps, p.dim) for o in local]
    return torch.cat([pieces[r][i] for i in range(len(steps)) for r in range(world_size)], p.dim)


def _simulate(target: Any, args: tuple, placements: list[Any], world_size: int) -> tuple[Any, list[Any]]:
    """Ask the rule, then run its single candidate on every rank (strided inputs cut by
    :func:`strided_pieces`, Shard by chunk, R whole); returns (candidate, per-rank outputs)."""

    (cand,) = ask(target, args, placements, world_size)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    per_rank = []
    for r in range(world_size):
        it = iter(placements)
        local = []
        for a in args:
            if not isinstance(a, torch.Tensor):
                local.append(a)
                continue
            p = next(it)
            if isinstance(p, StridedShard):
                local.append(strided_pieces(a, p, world_size)[r])
            elif isinstance(p, Shard):
                local.append(a.chunk(world_size, p.dim)[r])
            else:
                local.append(a)
        if cand.local is None:
            per_rank.append(target(*local))
        else:
            per_rank.append(registry.local_impl(cand.local)(target, tuple(local), {}, placements, cand.output, r,
                                                            world_size))
    assert tensors
    return cand, per_rank


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_fused_projection_sharded_strided_splits_into_plain_head_shards(world_size: int) -> None:
    # GPT-2's c_attn: addmm(bias, x, W (in, q|k|v)) then split(64) along the fused dim

    segs = (16, 8, 8)  # q | k | v of different sizes (GQA), each divisible by 2 and 4
    bias, x, w = f(32), f(6, 12), f(12, 32)
    cand, outs = _simulate(aten.addmm.default, (bias, x, w), [StridedShard(0, segs), R, StridedShard(1, segs)],
                           world_size)
    assert cand.output == StridedShard(1, segs) and cand.local is None
    full = torch.addmm(bias, x, w)
    # each rank computes whole dot products for its own output columns; only the GEMM kernel's
    # blocking for the narrower output may reorder a sum (fp32 rounding, < 1e-6 here)
    for r, o in enumerate(outs):
        torch.testing.assert_close(o, strided_pieces(full, StridedShard(1, segs), world_size)[r], rtol=1e-6, atol=1e-6)
    cand, pieces = _simulate(aten.split_with_sizes.default, (full, list(segs), 1), [StridedShard(1, segs)],
                             world_size)
    assert cand.output == (Shard(1),) * 3 and cand.local == "split_sizes"
    for j, whole in enumerate(full.split(list(segs), 1)):
        torch.testing.assert_close(torch.cat([p[j] for p in pieces], 1), whole, rtol=0, atol=0)
    # Phi-3 cuts with slices instead: qkv[..., 16:24] is the k segment
    cand, ks = _simulate(aten.slice.Tensor, (full, 1, 16, 24), [StridedShard(1, segs)], world_size)
    assert cand.output == Shard(1) and cand.local == "slice_bounds"
    torch.testing.assert_close(torch.cat(ks, 1), full[:, 16:24], rtol=0, atol=0)


def test_a_fused_shard_survives_only_ops_that_keep_its_dim_whole() -> None:

    fused = StridedShard(2, (8, 8, 8))
    x = f(2, 3, 24)
    assert outputs(ask(aten.view.default, (x, [6, 24]), [fused])) == [(StridedShard(1, (8, 8, 8)), "shape")]
    assert outputs(ask(aten.gelu.default, (x,), [fused])) == [(fused, None)]
    # cut into heads of 4, each rank's chunk of each segment is whole heads (1 of q, of k, of v)
    assert outputs(ask(aten.view.default, (x, [2, 3, 6, 4]), [fused])) == [(StridedShard(2, (2, 2, 2)), "shape")]
    # merging the fused dim with the one before it, and cuts other than its segments, mix q, k and v
    # rows: rejected, with a reason
    for target, args in ((aten.view.default, (x, [2, 72])), (aten.split.Tensor, (x, 12, 2)),
                         (aten.slice.Tensor, (x, 2, 0, 12)), (aten._softmax.default, (x, 2, False)),
                         (aten.cat.default, ([x, x], 0))):
        placements = [fused] * (2 if target is aten.cat.default else 1)
        cands = ask(target, args, placements)
        assert cands == [] and cands.reason, f"{target} accepted a fused shard: {cands}"
    # a fused shard never mixes with a plain one or another fusion
    assert ask(aten.add.Tensor, (x, x), [fused, Shard(2)]) == []
    assert ask(aten.add.Tensor, (x, x), [fused, StridedShard(2, (12, 12))]) == []


def test_fused_segmentations_are_read_off_splits_and_tiling_slices() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from autotp.ops.fused import fused_segmentations, strided_candidates

    def program(qkv: torch.Tensor, gate_up: torch.Tensor) -> tuple:
        q, k, v = qkv[..., :16], qkv[..., 16:24], qkv[..., 24:]
        gate, up = gate_up.chunk(2, dim=-1)
        return q, k, v, gate * up

    gm = make_fx(program)(torch.randn(2, 32), torch.randn(2, 40))
    found = fused_segmentations(gm.graph, 2)
    assert found == {32: {((16, 8, 8), (), (), ())}, 40: {((20, 20), (), (), ())}}
    # 8 does not divide by 16: k and v held whole beside a split q; gate | up, all whole, is no layout
    assert fused_segmentations(gm.graph, 16) == {32: {((16, 8, 8), (1, 2), (), ())}}
    assert strided_candidates((32, 12), found) == [StridedShard(0, (16, 8, 8))]


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_fused_multi_query_projection_splits_its_q_heads_and_keeps_its_k_and_v_head_whole(world_size: int) -> None:
    # Falcon-7B's query_key_value: (B, S, (H+2)*D) viewed as (B, S, H+2, D), then q = [..., :-2, :]
    # and its one k head = [..., [-2], :]; every rank holds its q heads and the whole k and v head
    heads, head_dim = 8, 4
    fused = StridedShard(2, (heads * head_dim, head_dim, head_dim), whole=(1, 2))
    assert str(fused) == "S(2|32+4r+4r)" and parse(str(fused)) == fused
    x = f(2, 3, (heads + 2) * head_dim)
    cand, split = _simulate(aten.view.default, (x, [2, 3, heads + 2, head_dim]), [fused], world_size)
    by_heads = StridedShard(2, (heads, 1, 1), whole=(1, 2))
    assert cand.output == by_heads and cand.local == "shape"
    full = x.view(2, 3, heads + 2, head_dim)
    for r, o in enumerate(split):
        assert o.shape[2] == heads // world_size + 2
        torch.testing.assert_close(o, strided_pieces(full, by_heads, world_size)[r], rtol=0, atol=0)
    cand, qs = _simulate(aten.slice.Tensor, (full, 2, 0, -2), [by_heads], world_size)
    assert cand.output == Shard(2) and cand.local == "slice_bounds"
    torch.testing.assert_close(torch.cat(qs, 2), full[:, :, :-2], rtol=0, atol=0)
    index = torch.tensor([-2])
    (cand,) = ask(aten.index.Tensor, (full, [None, None, index]), [by_heads, R], world_size)
    assert cand.output == R and cand.local == "slice_bounds"
    for r, local in enumerate(split):
        k = registry.local_impl(cand.local)(aten.index.Tensor, (local, [None, None, index]), {}, [by_heads, R],
                                            R, r, world_size)
        torch.testing.assert_close(k, full[:, :, [-2]], rtol=0, atol=0)
    # an index into the split q heads, or one that spans segments, is refused
    for picked in ([0], [7, 8]):
        assert ask(aten.index.Tensor, (full, [None, None, torch.tensor(picked)]), [by_heads, R], world_size) == []
    # a matmul contracting the fused dim would count every rank's copy of k and v: no partial sum
    contracted = [StridedShard(1, (32, 4, 4), (1, 2)), StridedShard(0, (32, 4, 4), (1, 2))]
    assert ask(aten.mm.default, (f(5, 40), f(40, 6)), contracted, world_size) == []


def test_a_sharded_dropout_draws_its_own_mask_per_rank_and_follows_the_seed() -> None:
    """native_dropout on S(0): each rank's stream differs from the others' and from the default
    generator's, is a function of the seed (same seed, same masks), and keeps the default
    generator advancing alike on every rank (the replicated stream stays in sync)."""
    rule = registry.lookup(aten.native_dropout.default)
    spec = TensorSpec((8, 64), torch.float32)
    op = OpCall(aten.native_dropout.default, (spec, 0.5, True), {}, (spec, TensorSpec((8, 64), torch.bool)), 2)
    (cand,) = rule(op, [Shard(0)])
    assert cand.output == (Shard(0), Shard(0)) and cand.local == RANK_RNG
    impl = registry.local_impl(RANK_RNG)
    x = torch.ones(4, 64)

    def masks(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        out, after = [], []
        for rank in range(2):
            torch.manual_seed(seed)
            out.append(impl(aten.native_dropout.default, (x, 0.5, True), {}, [Shard(0)], cand.output, rank, 2)[1])
            after.append(torch.rand(3))  # the default stream right after the op
        return out, after

    first, after = masks(0)
    assert not torch.equal(first[0], first[1])  # ranks draw different masks
    torch.manual_seed(0)
    assert not torch.equal(first[0], torch.ops.aten.native_dropout.default(x, 0.5, True)[1])
    assert torch.equal(after[0], after[1])  # replicated regions stay in sync
    again, _ = masks(0)
    other, _ = masks(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])


def test_heads_merged_behind_the_batch_stay_sharded_as_a_strided_shard() -> None:
    """Eager attention at batch 2: (B, H, S, D) heads-sharded -> (B*H, S, D) is B segments of H
    (rank r holds chunk r of each batch's heads), bmm and softmax keep it, and the split back to
    (B, H, S, S) is a plain head shard again. BLOOM's alibi is (H, 1, S) repeated B times."""
    merged = StridedShard(0, (8, 8))
    assert outputs(ask(aten.view.default, (f(2, 8, 5, 4), [16, 5, 4]), [Shard(1)])) == [(merged, "shape")]
    assert outputs(ask(aten.bmm.default, (f(16, 5, 4), f(16, 4, 5)), [merged, merged])) == [(merged, None)]
    assert outputs(ask(aten._softmax.default, (f(16, 5, 5), -1, False), [merged])) == [(merged, None)]
    assert outputs(ask(aten.view.default, (f(16, 5, 5), [2, 8, 5, 5]), [merged])) == [(Shard(1), "shape")]
    assert outputs(ask(aten.repeat.default, (f(8, 1, 5), [2, 1, 1]), [Shard(0)])) == [(merged, None)]
    assert outputs(ask(aten.baddbmm.default, (f(16, 1, 5), f(16, 5, 4), f(16, 4, 5)), [merged] * 3)) \
        == [(merged, None)]
    # a plain head shard of the merged dim would be wrong (rank 0 would hold all of batch 0)
    assert ask(aten.bmm.default, (f(16, 5, 4), f(16, 4, 5)), [merged, Shard(0)]) == []
    # three segments over four ranks: each rank's share of a segment is whole rows
    assert outputs(ask(aten.view.default, (f(3, 8, 4), [24, 4]), [Shard(1)], world_size=4)) \
        == [(StridedShard(0, (8, 8, 8)), "shape")]
    # local sizes: the merged size is divided by N like a plain shard's ((B*H)/N rows per rank)
    assert localize_sizes([16, 5, 4], merged, 2) == [8, 5, 4]


def test_a_strided_merge_may_lie_on_a_dynamic_batch_only_with_static_segments() -> None:
    """After a batch-1 warm-up Dynamo makes the batch symbolic. ``(B*H)`` is then a symbolic dim,
    but its segments (H) are static, so the layout holds at every batch: the solver accepts an
    equal-segment strided shard there and nothing else."""
    f32 = torch.float32
    x = TensorSpec((2, 8, 5, 4), f32, frozenset({0}))
    heads = OpCall(aten.view.default, (x, [16, 5, 4]), {}, TensorSpec((16, 5, 4), f32, frozenset({0})), 2)
    (cand,) = registry.lookup(aten.view.default)(heads, [Shard(1)])
    assert cand.output == StridedShard(0, (8, 8))
    assert cand.output.segment_size == 8 and StridedShard(0, (16, 8, 8)).segment_size is None
    spec = TensorSpec((16, 5, 4), f32, frozenset({0}))
    assert spec.shardable(0, StridedShard(0, (8, 8)))
    assert not spec.shardable(0, Shard(0)) and not spec.shardable(0, StridedShard(0, (8, 4, 4)))
    # BLOOM's padded alibi (B, H, S) -> (B*H, 1, S), batch and length symbolic: segments of H
    alibi = OpCall(aten.view.default, (TensorSpec((2, 8, 5), f32, frozenset({0, 2})), [16, 1, 5]), {},
                   TensorSpec((16, 1, 5), f32, frozenset({0, 2})), 2)
    assert outputs(registry.lookup(aten.view.default)(alibi, [Shard(1)])) == [(StridedShard(0, (8, 8)), "shape")]
    # merged with the symbolic sequence too, a segment would be H*S: not static, refused
    flat = OpCall(aten.view.default, (TensorSpec((2, 8, 5, 4), f32, frozenset({0, 2})), [80, 4]), {},
                  TensorSpec((80, 4), f32, frozenset({0})), 2)
    assert registry.lookup(aten.view.default)(flat, [Shard(1)]) == []
