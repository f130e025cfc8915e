"""The peer benchmark (peers/vit_bench.py) with timm's activation checkpointing on every block.

The large-image table's checkpointed row (ViT-L/16 at 1024 px) recomputes each block's forward in
the backward; comparing it with a peer that keeps every activation compares two different
amounts of work. This runs the same peer script with `model.set_grad_checkpointing(True)` on
each model timm creates (timm then wraps every block in torch.utils.checkpoint), and marks its
JSON lines with "checkpointed": true.
  python3 scripts/peer_checkpointed.py PEER_SCRIPT [the peer's arguments]
"""
import json
import runpy
import sys

import timm

create = timm.create_model


def create_checkpointed(*args, **kwargs):
    model = create(*args, **kwargs)
    model.set_grad_checkpointing(True)
    return model


timm.create_model = create_checkpointed


class MarkLines:
    """Adds "checkpointed": true to every JSON line the peer prints."""

    def __init__(self, out):
        self.out = out

    def write(self, text):
        lines = []
        for line in text.split("\n"):
            if line.startswith("{"):
                try:
                    row = json.loads(line)
                except ValueError:
                    # not a result line: passed on as it is
                    lines.append(line)
                    continue
                row["checkpointed"] = True
                line = json.dumps(row)
            lines.append(line)
        return self.out.write("\n".join(lines))

    def flush(self):
        self.out.flush()


if len(sys.argv) < 2:
    sys.exit("usage: peer_checkpointed.py PEER_SCRIPT [ARGS...]")
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.stdout = MarkLines(sys.stdout)
runpy.run_path(script, run_name="__main__")
