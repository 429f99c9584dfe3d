"""`python -m titan [--job.config_file FILE.toml] [--section.key VALUE ...]`: the same entry point
as train.py at the repository root, for launchers that take a module (`torchrun ... -m titan`)."""

import sys

from titan.launch.entry import main

sys.exit(main(sys.argv[1:]))
