"""Entry point for the DeepSpeed launcher (same flags as `specdraft train`):

    deepspeed --num_gpus 2 launch/train_draft.py --config configs/medusa.yaml [key=value ...]

Named train_draft.py, not train.py: a script's directory goes first on sys.path, and launch/train.py
would shadow the `train` package.
"""

import sys

from cli.main import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
