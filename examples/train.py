#!/usr/bin/env python3
"""A tiny, deterministic training loop that behaves as spotguard expects (standard library only).

- Saves a checkpoint every --save-every steps into $SPOTGUARD_CHECKPOINT_DIR (./checkpoints
  when run alone), written to a hidden temporary dir first and renamed into place, so a
  half-written checkpoint is never mistaken for a complete one.
- On SIGTERM (what spotguard sends on a preemption notice) it finishes the current step, saves,
  and exits 0. $SPOTGUARD_NOTICE_FILE says why and by when.
- Resumes from $SPOTGUARD_RESUME_DIR when it is set (the newest complete checkpoint).

The weights depend only on the step count, so an interrupted-and-resumed run ends bit for bit
where an uninterrupted one does.

    spotguard run --simulate-preemption 5s -- python3 examples/train.py
"""
import argparse
import json
import os
import signal
import struct
import sys
import time

stop_requested = False


def on_stop(signum, _frame):
    global stop_requested
    stop_requested = True


def batch(step, n=32):
    """Deterministic data for `step`: y = 3x - 2 plus a little noise, from an LCG."""
    seed = (step * 2654435761 + 12345) & 0xFFFFFFFF
    xs, ys = [], []
    for _ in range(n):
        seed = (1103515245 * seed + 12345) & 0x7FFFFFFF
        x = seed / 0x7FFFFFFF * 2 - 1
        seed = (1103515245 * seed + 12345) & 0x7FFFFFFF
        noise = (seed / 0x7FFFFFFF - 0.5) * 0.01
        xs.append(x)
        ys.append(3 * x - 2 + noise)
    return xs, ys


def train_step(w, b, step, lr=0.05):
    xs, ys = batch(step)
    gw = sum((w * x + b - y) * x for x, y in zip(xs, ys)) * 2 / len(xs)
    gb = sum((w * x + b - y) for x, y in zip(xs, ys)) * 2 / len(xs)
    return w - lr * gw, b - lr * gb


def save(ckpt_dir, step, w, b):
    final = os.path.join(ckpt_dir, f"step-{step:08d}")
    if os.path.exists(final):
        return final
    tmp = os.path.join(ckpt_dir, f".step-{step:08d}.tmp")
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "weights.bin"), "wb") as f:
        f.write(struct.pack("<dd", w, b))
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump({"step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)  # atomic: the checkpoint appears complete or not at all
    return final


def load(resume_dir):
    with open(os.path.join(resume_dir, "state.json")) as f:
        step = json.load(f)["step"]
    with open(os.path.join(resume_dir, "weights.bin"), "rb") as f:
        w, b = struct.unpack("<dd", f.read())
    return step, w, b


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--step-time", type=float, default=0.02, help="seconds of pretend work per step")
    a = p.parse_args()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    ckpt_dir = os.environ.get("SPOTGUARD_CHECKPOINT_DIR", "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)

    step, w, b = 0, 0.0, 0.0
    resume = os.environ.get("SPOTGUARD_RESUME_DIR")
    if resume:
        step, w, b = load(resume)
        print(f"resumed from {resume} at step {step}", flush=True)

    print(f"training from step {step}", flush=True)
    while step < a.steps:
        w, b = train_step(w, b, step)
        step += 1
        time.sleep(a.step_time)
        if step % a.save_every == 0:
            print(f"step {step}: w={w:.6f} b={b:.6f} saved {save(ckpt_dir, step, w, b)}", flush=True)
        if stop_requested:
            notice = os.environ.get("SPOTGUARD_NOTICE_FILE")
            why = ""
            if notice and os.path.exists(notice):
                with open(notice) as f:
                    n = json.load(f)
                why = f" ({n['source']} notice, deadline {n['deadline']})"
            path = save(ckpt_dir, step, w, b)
            print(f"stopping at step {step}{why}; saved {path}", flush=True)
            return 0

    save(ckpt_dir, step, w, b)
    print(f"done: step {step} w={w!r} b={b!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
