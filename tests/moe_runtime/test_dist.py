"""Expert placement, the multicast-safety environment and the single-process paths of moe_runtime.dist."""

import os

import pytest
import torch

from moe_runtime.dist import (apply_multicast_safety_env, expert_placement, group_rank, group_size, init_distributed,
                              kMulticastSafetyEnv, rank_print, reduce_rows_to_owners, uneven_all_gather)


@pytest.mark.parametrize("num_experts,ep_size", [(8, 1), (8, 2), (256, 8), (6, 3)])
def test_placement(num_experts, ep_size):
    owners = []
    for rank in range(ep_size):
        p = expert_placement(num_experts, ep_size, rank)
        assert p.num_local_experts == num_experts // ep_size
        assert list(p.local_experts) == list(range(rank * p.num_local_experts, (rank + 1) * p.num_local_experts))
        owners += [p.owner(e) for e in p.local_experts]
    assert owners == [e // (num_experts // ep_size) for e in range(num_experts)]


@pytest.mark.parametrize("args,match", [
    ((10, 4, 0), "not divisible"),
    ((8, 0, 0), "ep_size"),
    ((0, 2, 0), "num_experts"),
    ((8, 2, 2), "ep_rank"),
])
def test_placement_errors(args, match):
    with pytest.raises(ValueError, match=match):
        expert_placement(*args)
    if match == "not divisible":
        with pytest.raises(ValueError, match="num_experts=10"):
            expert_placement(*args)


@pytest.mark.parametrize("fn", [group_size, group_rank])
@pytest.mark.parametrize("group", ["world", 0, object()])
def test_group_must_be_a_process_group(fn, group):
    with pytest.raises(TypeError, match="process group must be None or a torch.distributed.ProcessGroup, got "
                                        f"{type(group).__name__}"):
        fn(group)


def test_owner_out_of_range():
    with pytest.raises(ValueError, match="expert must be in"):
        expert_placement(8, 2, 0).owner(8)


def test_multicast_env_on_a_child_environment():
    env = {"PATH": "/bin", "NCCL_NVLS_ENABLE": "1"}
    out = apply_multicast_safety_env(env)
    assert out is env and env["NCCL_NVLS_ENABLE"] == "0"
    assert all(env[k] == v for k, v in kMulticastSafetyEnv.items())


def test_single_process_context(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name in kMulticastSafetyEnv:
        monkeypatch.delenv(name, raising=False)
    ctx = init_distributed(device="cpu")
    assert (ctx.rank, ctx.world_size, ctx.is_distributed, ctx.ep_size, ctx.ep_rank) == (0, 1, False, 1, 0)
    assert all(os.environ[k] == v for k, v in kMulticastSafetyEnv.items())
    assert ctx.placement(16).num_local_experts == 16
    ctx.destroy()


@pytest.mark.parametrize("env", [dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", LOCAL_RANK="2"),
                                 dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", LOCAL_RANK="-1"),
                                 dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="4", LOCAL_RANK="0")])
def test_inconsistent_torchrun_environment_is_refused(monkeypatch, env):
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match="need 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE"):
        init_distributed(device="cpu")


def test_rank_print_takes_print_arguments(capsys):
    rank_print("a", 1, sep="-", end="!\n", flush=True)
    rank_print("b", sep=None, end=None)
    assert capsys.readouterr().out == "[rank 0/1]-a-1!\n[rank 0/1] b\n"


def test_single_process_collectives():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 2).to(torch.bfloat16)
    gathered, counts = uneven_all_gather(x)
    assert gathered is x and counts == [5]
    rows = torch.randn(5, 4)
    assert reduce_rows_to_owners(rows, [5]) is rows


def test_rank_print(capsys):
    rank_print("hello", 3)
    rank_print("hidden", only_rank=1)
    assert capsys.readouterr().out == "[rank 0/1] hello 3\n"
