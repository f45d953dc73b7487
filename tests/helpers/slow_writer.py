#!/usr/bin/env python3
"""Writes one checkpoint into $SPOTGUARD_CHECKPOINT_DIR slowly, in a given framework's layout,
pausing between pieces longer than the tests' settle time. Prints `complete NAME BYTES` when
the checkpoint is whole, then waits for stdin to close (so spotguard's rules, not the command's
exit, decide when the checkpoint is complete).

    slow_writer.py MODE [--pause SECONDS]

MODE: rename | huggingface | dcp | marker | quiescent | lightning
"""
import os
import sys
import time

MODE = sys.argv[1]
PAUSE = float(sys.argv[sys.argv.index("--pause") + 1]) if "--pause" in sys.argv else 1.5
ROOT = os.environ["SPOTGUARD_CHECKPOINT_DIR"]
CHUNK = b"x" * 65536


def put(path, n_chunks=4):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        for _ in range(n_chunks):
            f.write(CHUNK)
    return n_chunks * len(CHUNK)


def total(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def slowly(pieces):
    for i, piece in enumerate(pieces):
        if i:
            time.sleep(PAUSE)
        piece()


def main():
    if MODE == "rename":
        tmp, name = os.path.join(ROOT, ".step-1.tmp"), "step-1"
        slowly([lambda: put(f"{tmp}/model.bin"), lambda: put(f"{tmp}/optim.bin")])
        time.sleep(PAUSE)
        os.rename(tmp, os.path.join(ROOT, name))
    elif MODE == "huggingface":
        d, name = os.path.join(ROOT, "checkpoint-10"), "checkpoint-10"
        slowly([
            lambda: put(f"{d}/model.safetensors"),
            lambda: put(f"{d}/optimizer.pt"),
            lambda: put(f"{d}/trainer_state.json", 1),
        ])
    elif MODE == "dcp":
        d, name = os.path.join(ROOT, "step-20"), "step-20"
        slowly([lambda: put(f"{d}/__0_0.distcp"), lambda: put(f"{d}/__1_0.distcp"), lambda: put(f"{d}/.metadata", 1)])
    elif MODE == "marker":
        d, name = os.path.join(ROOT, "weights"), "weights"
        slowly([lambda: put(f"{d}/a.bin"), lambda: put(f"{d}/b.bin")])
        time.sleep(PAUSE)
        open(os.path.join(ROOT, "weights.complete"), "w").close()
    elif MODE in ("quiescent", "lightning"):
        name = "blob" if MODE == "quiescent" else "epoch=1.ckpt"
        path = os.path.join(ROOT, name, "data.bin") if MODE == "quiescent" else os.path.join(ROOT, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # One handle held open across the pauses: "open for writing" must veto completion.
        with open(path, "wb") as f:
            for i in range(3):
                if i:
                    time.sleep(PAUSE)
                f.write(CHUNK * 4)
                f.flush()
    else:
        sys.exit(f"unknown mode {MODE}")
    print(f"complete {name} {total(os.path.join(ROOT, name))}", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
