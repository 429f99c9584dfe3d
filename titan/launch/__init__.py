"""Launching: the torchrun supervisor run_train.sh and the Slurm script use (``python -m
titan.launch``), the config check before any rank starts (``python -m titan.launch.check``), and
the ranks' side: error reports the launcher can print last, and stopping when the launcher dies.
"""
