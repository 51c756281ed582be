"""The README's plain ``accelerate`` loop on 2 CPU processes (run under torchrun), checked after every
``accelerator.backward`` inside ``accelerator.accumulate(model)`` as a plain-loop user writes it."""

import json
import os
import sys
import warnings

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradhealth as gh


def main(out: str, mode: str) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    with torch.no_grad():
        before = nn.functional.mse_loss(model(x), y).item()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    monitor = gh.GradHealth(accelerator.unwrap_model(model), optimizer, on_problem="raise")
    checks, losses, said = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                report = monitor.check(loss)             # the one line after backward
                checks.append(None if report is None else [report.ok, accelerator.sync_gradients])
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
    with torch.no_grad():
        after = nn.functional.mse_loss(accelerator.unwrap_model(model)(x), y).item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = accelerator.gather(flat.unsqueeze(0))
    monitor.close()
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"checks": checks, "losses": losses, "said": said, "world": accelerator.num_processes,
                   "same": bool(torch.equal(gathered[0], gathered[-1])), "ddp": type(model).__name__,
                   "found_ddp": monitor.ranks.ddp is model,
                   "before": before, "after": after}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # (as the docs end a script: the process group destroyed, not torn down at exit)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ok")
