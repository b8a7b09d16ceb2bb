"""``verify=True`` (tp=2, gloo): a correct plan passes silently; a wrong rule is caught at its node.

Tolerance: autotp/verify.py compares fp32 values at rtol 1e-4 of the tensor's largest magnitude
plus atol 1e-5; the wrong rule below is off by a factor of 2 (half of a sum), far outside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist


def _rank_verified_llama(rank: int, world: int, folder: str) -> torch.Tensor:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world, verify=True)
    with torch.no_grad():
        return model(input_ids=torch.tensor([[5, 17, 99, 3, 64]])).logits


def test_a_verified_llama_runs_and_matches_one_process(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path / "ckpt", seed=0, num_hidden_layers=2)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=torch.tensor([[5, 17, 99, 3, 64]])).logits
    for logits in run_ranks(_rank_verified_llama, 2, str(folder)):
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-4)


def _rank_wrong_rule(rank: int, world: int) -> str:
    """A sum over a sharded dim is partial; a rule that claims it is replicated is wrong, and the
    solver likes it (it saves an all-reduce)."""
    import autotp.passes.solve as solve_module
    from autotp.backend import make_backend
    from autotp.collectives import Comm
    from autotp.config import AutoTPConfig
    from autotp.context import TPContext
    from autotp.errors import AutoTPError
    from autotp.ops.registry import Candidate
    from autotp.placement import Partial, R

    real = solve_module.lookup

    def lookup(target: object) -> object:
        rule = real(target)
        if target is not torch.ops.aten.sum.dim_IntList:
            return rule
        return lambda call, ins: [Candidate(R if isinstance(c.output, Partial) else c.output, c.local)
                                  for c in rule(call, ins)]

    solve_module.lookup = lookup
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU())
    ctx = TPContext(comm=Comm.from_default_group(), config=AutoTPConfig(verify=True))
    compiled = torch.compile(lambda x: net(x).sum(-1), backend=make_backend(ctx))
    try:
        with torch.no_grad():
            compiled(torch.randn(3, 8))
    except AutoTPError as err:
        return str(err)
    return "no error"


def test_a_wrong_rule_is_reported_at_the_first_diverging_node_on_every_rank() -> None:
    for message in run_ranks(_rank_wrong_rule, 2):
        assert "diverges from the replicated run first at Dynamo node sum" in message, message
        assert "placed R" in message


def _rank_wrong_rule_through_the_backend_name(rank: int, world: int, verify_env: str | None) -> str:
    """The same wrong rule, compiled with ``torch.compile(..., backend="autotp")``: the backend's
    entry point reads ``AUTOTP_VERIFY``."""
    import os

    import autotp.passes.solve as solve_module
    from autotp.errors import AutoTPError
    from autotp.ops.registry import Candidate
    from autotp.placement import Partial, R

    if verify_env is not None:
        os.environ["AUTOTP_VERIFY"] = verify_env
    real = solve_module.lookup

    def lookup(target: object) -> object:
        rule = real(target)
        if target is not torch.ops.aten.sum.dim_IntList:
            return rule
        return lambda call, ins: [Candidate(R if isinstance(c.output, Partial) else c.output, c.local)
                                  for c in rule(call, ins)]

    solve_module.lookup = lookup
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU())
    compiled = torch.compile(lambda x: net(x).sum(-1), backend="autotp")
    try:
        with torch.no_grad():
            compiled(torch.randn(3, 8))
    except AutoTPError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("verify_env", ["1", None])
def test_autotp_verify_1_turns_verification_on_for_the_backend_name(verify_env: str | None) -> None:
    for message in run_ranks(_rank_wrong_rule_through_the_backend_name, 2, verify_env):
        if verify_env == "1":
            assert "diverges from the replicated run first at Dynamo node sum" in message, message
        else:  # without the variable nothing checks the (deliberately wrong) plan
            assert message == "no error"
