"""Launching, in one direction: ``report`` (a user error is one line and exit status 2) <- ``check``
(the config check before any rank starts, ``python -m titan.launch.check``, and --help) <- ``entry``
(what every rank runs: train.py and ``python -m titan.train``) and ``supervisor`` (torchrun with
signal forwarding, the cause line and ``restarts``: ``python -m titan.launch``, used by run_train.sh
and the Slurm script). ``parent``: a rank stops when its launcher dies.
"""
