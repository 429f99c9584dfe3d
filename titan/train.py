"""`python -m titan.train [--job.config_file FILE.toml] [--section.key VALUE ...]`: the same entry
point as train.py at the repository root (titan/launch/entry.py), for launchers that take a module
(`torchrun ... -m titan.train`). The training loop's parts are in titan/training/."""

import sys

from titan.launch.entry import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
