"""Entry point: `torchrun --nproc_per_node N train.py --job.config_file train_configs/debug_model.toml`.

The same as `python -m titan.train ...` (titan/launch/entry.py), for launchers that take a script path.
"""

import sys

from titan.launch.entry import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
