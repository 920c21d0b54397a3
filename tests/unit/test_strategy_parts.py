"""Pure parts of the pipeline and Horovod strategies: the loss scale, the missing-Horovod error, horovodrun
(the pipeline's split: test_pipeline_split.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime.env import DistEnv
from cyclone_kit.runtime.hvd import gloo_slot_env, horovodrun_command, import_horovod, node_key, uses_gloo_rendezvous


def test_missing_horovod_is_a_one_line_error_naming_the_module_and_the_build_script(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # import fails
    with pytest.raises(ValidationError) as info:
        import_horovod()
    err = info.value
    text = f"{err} {getattr(err, 'hint', '')}"
    assert "\n" not in str(err) and "horovod" in str(err).lower()
    assert "module load Horovod" in text and "scripts/build-horovod.sh" in text


def test_horovodrun_command_spreads_ranks_over_hosts() -> None:
    cmd = horovodrun_command("/runs/r1", 4, hosts=("n1", "n2"), python="py", interface=None)
    assert cmd == ["horovodrun", "--gloo", "-np", "4", "-H", "n1:2,n2:2",
                   "py", "-m", "cyclone_kit.runtime", "--run-dir", "/runs/r1"]
    assert horovodrun_command("d", 2, python="py")[5:8] == ["localhost:2", "--network-interfaces", "lo"]
    with pytest.raises(ValidationError):
        horovodrun_command("d", 3, hosts=("a", "b"))


def _env(rank: int, local_rank: int, node: int, hosts: tuple[str, ...] = ("c1", "c2"), per: int = 2) -> DistEnv:
    return DistEnv(rank=rank, local_rank=local_rank, world_size=per * 2, local_world_size=per, node_rank=node,
                   num_nodes=2, master_addr="c1", master_port=15000, launcher="slurm", hostnames=hosts)


def test_gloo_rendezvous_is_ours_only_when_neither_horovodrun_nor_mpi_gave_the_ranks() -> None:
    two = _env(0, 0, 0)
    assert uses_gloo_rendezvous(two, {}, mpi_built=False)
    assert not uses_gloo_rendezvous(two, {"HOROVOD_RANK": "0"}, mpi_built=False)  # horovodrun did it
    assert not uses_gloo_rendezvous(two, {}, mpi_built=True)  # MPI gives the ranks
    assert uses_gloo_rendezvous(two, {"HOROVOD_CONTROLLER": "gloo"}, mpi_built=True)  # the user prefers Gloo
    assert not uses_gloo_rendezvous(DistEnv(), {}, mpi_built=False)  # one process: nothing to meet


def test_gloo_slot_env_is_what_horovodrun_gives_the_slot() -> None:
    env = gloo_slot_env(_env(3, 1, 1), "c1", 4242)
    assert env == {
        "HOROVOD_HOSTNAME": "c2", "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "c1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "4242",
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
    }
    # Without a full host list the scope key is the node index, the same on every rank of a node.
    assert node_key(_env(3, 1, 1, hosts=()), 1) == "node1"


def test_gloo_rendezvous_refuses_uneven_ranks_per_node() -> None:
    uneven = DistEnv(rank=0, local_rank=0, world_size=3, local_world_size=2, node_rank=0, num_nodes=2,
                     launcher="slurm")
    with pytest.raises(ValidationError, match="same number of ranks on every node") as info:
        gloo_slot_env(uneven, "c1", 1)
    assert "--ntasks-per-node" in info.value.hint


def test_rendezvous_plan_sizes_horovods_scopes() -> None:
    pytest.importorskip("horovod.runner.http.http_server", reason="Horovod not installed (scripts/build-horovod.sh)")
    from horovod.runner.http.http_server import RendezvousHTTPServer

    from cyclone_kit.runtime.hvd import rendezvous_plan

    plan = rendezvous_plan(_env(0, 0, 0))
    assert [(s.hostname, s.rank, s.local_rank, s.cross_rank) for s in plan] == [
        ("c1", 0, 0, 0), ("c1", 1, 1, 0), ("c2", 2, 0, 1), ("c2", 3, 1, 1)]
    server = RendezvousHTTPServer.__new__(RendezvousHTTPServer)  # only the scope arithmetic, no socket
    server.scope_size = {}
    server._extract_scope_size(plan)
    assert server.scope_size == {"global": 4, "local_c1": 2, "local_c2": 2, "cross_0": 2, "cross_1": 2}


def test_loss_scale_skips_a_step_with_inf_gradients_and_halves_the_scale() -> None:
    from cyclone_kit.runtime.engine.pipeline import LossScale

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = LossScale(init_scale=8.0, growth_interval=2)
    p.grad = torch.tensor([8.0, 16.0, float("inf")])
    assert float(scaler.step(opt)) == 1.0 and float(scaler.scale) == 4.0  # skipped
    torch.testing.assert_close(p.detach(), torch.ones(3))  # not stepped
    p.grad = torch.tensor([4.0, 8.0, 0.0])  # gradients scaled by 4
    assert float(scaler.step(opt)) == 0.0
    torch.testing.assert_close(p.detach(), torch.tensor([0.0, -1.0, 1.0]))  # unscaled: 1, 2, 0
    p.grad = torch.zeros(3)
    assert float(scaler.step(opt)) == 0.0 and float(scaler.scale) == 8.0  # 2 good steps: grows
    assert scaler.state_dict() == {"scale": 8.0, "good": 0}
    p.grad = torch.zeros(3)
    scaler.step(opt)
    restored = LossScale(growth_interval=2)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == {"scale": 8.0, "good": 1}
    restored.load_state_dict({"scale": 2.0, "good": 5})  # an older checkpoint counted every good step
    assert restored.state_dict() == {"scale": 2.0, "good": 1}
