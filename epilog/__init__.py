"""Slurm node Epilog (root, once per job per node)."""
