#!/usr/bin/env python3
"""A small PyTorch training loop written for spotguard (copy it into your project).

- Stops cleanly on SIGTERM: finishes the step, saves, exits 0.
- Saves with write-then-rename into $SPOTGUARD_CHECKPOINT_DIR, so spotguard uploads each
  checkpoint the moment it is complete and never a half-written one.
- Resumes from $SPOTGUARD_RESUME_DIR: model, optimizer, step and every RNG state, so a
  resumed run continues exactly where the saved one stopped.

    spotguard run --store s3://bucket/jobs --job mnist -- python examples/train_pytorch.py
"""
import os
import random
import signal
import sys

import numpy as np
import torch
from torch import nn

stop = False


def on_sigterm(*_):
    global stop
    stop = True


def save(ckpt_dir, step, model, opt):
    final = os.path.join(ckpt_dir, f"step-{step:08d}")
    tmp = os.path.join(ckpt_dir, f".step-{step:08d}.tmp")  # ignored until renamed
    os.makedirs(tmp, exist_ok=True)
    torch.save(
        {
            "step": step,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            },
        },
        os.path.join(tmp, "state.pt"),
    )
    os.rename(tmp, final)  # atomic: complete, or not there at all
    return final


def load(resume_dir, model, opt):
    state = torch.load(os.path.join(resume_dir, "state.pt"), weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]


def main(total_steps=2000, save_every=200):
    signal.signal(signal.SIGTERM, on_sigterm)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt_dir = os.environ.get("SPOTGUARD_CHECKPOINT_DIR", "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)

    step = 0
    if os.environ.get("SPOTGUARD_RESUME_DIR"):
        step = load(os.environ["SPOTGUARD_RESUME_DIR"], model, opt)
        print(f"resumed at step {step}", flush=True)

    while step < total_steps:
        x = torch.randn(256, 32, device=device)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % save_every == 0 or stop:
            print(f"step {step} loss {loss.item():.4f} saved {save(ckpt_dir, step, model, opt)}", flush=True)
        if stop:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
