"""Entry point for the DeepSpeed launcher (same flags as `specdraft cache`):

    deepspeed --num_gpus 8 launch/build_cache.py --config configs/medusa.yaml [base.partition=zero3] [key=value ...]

Every rank runs the frozen base over its own shards of the train rows; the result equals a one-rank build.
"""

import sys

from cli.main import main

if __name__ == "__main__":
    sys.exit(main(["cache", *sys.argv[1:]]))
