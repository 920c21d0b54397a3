"""A cyclone_kit-API DDP script with a fault the test injects: one rank sleeps forever at one step.

``python hang_script.py --steps N --hang-rank R --hang-step K``: on the first segment only
(``ctx.restart_count == 0`` and no in-job restart yet, ``CYCLONE_INJOB_RESTARTS``), rank R stops
before step K (it sleeps, holding no lock; its peers wait for it inside DDP's gradient all-reduce).
Every step is checkpointed, so a resumed segment repeats no step.

``--busy-step J --busy-s S``: before step J every rank computes for S seconds, on half a core (5 ms of
CPU time, then 5 ms asleep), between two ``ck.log_step`` calls: the script's own validation pass, which
ck is not told of.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import cyclone_kit as ck


def hang_forever() -> None:
    """The injected fault: this rank makes no progress any more."""
    while True:
        time.sleep(3600)


def validate_for(seconds: float) -> None:
    """A validation pass ck does not know of: computing in Python, no optimizer step."""
    end, acc = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        burst = time.process_time() + 0.005
        while time.process_time() < burst:
            acc += sum(i * i for i in range(1000))
        time.sleep(0.005)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hang-rank", type=int, default=1)
    parser.add_argument("--hang-step", type=int, default=15)
    parser.add_argument("--busy-step", type=int, default=0)
    parser.add_argument("--busy-s", type=float, default=0.0)
    args = parser.parse_args()

    ctx = ck.init()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    state = ck.load_checkpoint()
    if state is not None:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    generator = torch.Generator().manual_seed(ctx.rank)
    fresh = ctx.restart_count == 0 and os.environ.get("CYCLONE_INJOB_RESTARTS", "0") == "0"
    for step in range(start + 1, args.steps + 1):
        if fresh and ctx.rank == args.hang_rank and step == args.hang_step:
            hang_forever()
        if fresh and step == args.busy_step:
            validate_for(args.busy_s)
        x = torch.randn(16, 32, generator=generator)
        loss = F.mse_loss(model(x), torch.zeros(16, 4))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ck.log_step(step, samples=16 * ctx.world_size, loss=loss)
        ck.save_checkpoint({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step})
        if ck.stop_requested():
            break
    ck.finish()


if __name__ == "__main__":
    main()
